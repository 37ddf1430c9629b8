"""What a run needs before it starts, checked in seconds: shared by `rlship run` (and the
other commands, each for what applies to it) and `rlship doctor`.

Each check returns a `Check`: one line naming what was found, and for a failure what to do.
An operator mistake (a wrong password, a port in use, a database that does not exist, an
unwritable directory) must stop a run at once with that line, not hang it or end it in a
traceback; secrets never appear (every URL is shown through `mask_secrets`).
"""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import redis

from orchestrator.commands.findings import Check, require
from orchestrator.commands.redis_checks import (
    probe_redis,
    redis_can_be_started,
    redis_checks,
    wait_for_redis,
)
from orchestrator.settings import RunSettings
from orchestrator.worker_queries import queue_consumers
from transport.keys import RunKeys
from transport.port_claims import other_claimants, port_claims, port_holder


def run_id_free(client: redis.Redis, run_id: str) -> Check:
    """A run id already used: finished runs are refused, interrupted ones resumed (and said so)."""
    state = RunKeys(run_id)
    finished, next_step = client.mget(state.finished, state.next_step)
    records = client.hlen(state.published)
    if finished is not None:
        return Check(
            "run id",
            False,
            f"run id {run_id!r} was used by a run that finished ({records} records; its keys expire)",
            "choose another --run-id (or leave it out for a fresh one)",
        )
    if next_step is not None or records:
        return Check("run id", True, f"run {run_id!r} exists unfinished ({records} records): it resumes")
    return Check("run id", True, f"run id {run_id!r} is new")


# -- this machine -------------------------------------------------------------------------


def _bind_error(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound now, or None."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return str(exc.strerror or exc)
    return None


def port_pair_free(host: str, port: int) -> Check:
    """The ZMQ sender binds `port` and `port + 1` (READY): both must be free on `host`."""
    for candidate in (port, port + 1):
        if (error := _bind_error(host, candidate)) is not None:
            role = "zmq_port" if candidate == port else "zmq_port + 1 (trainers' READY)"
            held = f"; held by {holder}" if (holder := port_holder(candidate)) else ""
            return Check(
                "ports",
                False,
                f"{role} {host}:{candidate} cannot be bound ({error}{held})",
                "stop what holds it or choose another --zmq-port (it needs the port after it too)",
            )
    return Check("ports", True, f"{host}:{port} and {port + 1} are free for the ZMQ sender")


def ports_of_live_runs(client: redis.Redis) -> Check:
    """The ZMQ ports the live runs of this Redis hold (transport.port_claims)."""
    by_run: dict[tuple[str, str], list[int]] = {}
    for claim in port_claims(client):
        by_run.setdefault((claim.run_id, claim.host), []).append(claim.port)
    held = "; ".join(
        f"run {run_id} on {host}: {', '.join(map(str, ports))}"
        for (run_id, host), ports in sorted(by_run.items())
    )
    return Check("run ports", True, f"ZMQ ports held by live runs of this Redis: {held or 'none'}")


def ports_unclaimed(client: redis.Redis, settings: RunSettings) -> Check:
    """No other live run of this Redis holds the run's ZMQ port pair."""
    holders = other_claimants(client, settings.run_id, settings.zmq_host, settings.zmq_port)
    address = f"zmq_port {settings.zmq_host}:{settings.zmq_port} (or the READY port {settings.zmq_port + 1})"
    if holders:
        return Check(
            "ports",
            False,
            f"{address} is held by live run {', '.join(holders)} of this Redis",
            "choose another --zmq-port (or leave it unset: `rlship run` then takes a free pair)",
        )
    return Check("ports", True, f"{address} is held by no other live run of this Redis")


def metrics_port_free(host: str, port: int) -> Check:
    """The orchestrator's Prometheus endpoint (`metrics_port`) binds `host:port`."""
    if (error := _bind_error(host, port)) is not None:
        return Check(
            "metrics port",
            False,
            f"metrics_port {host}:{port} cannot be bound ({error})",
            "stop what holds it, choose another --metrics-port, or 0 to serve no metrics",
        )
    return Check("metrics port", True, f"{host}:{port} is free for the Prometheus endpoint")


def output_dir_writable(path: Path, *, create: bool = True) -> Check:
    """The run can write its files under `path`; `create=False` (`rlship doctor`) makes
    nothing: the directory, or the nearest one above it that exists, must let it."""
    if not create:
        existing = next(p for p in [path, *path.parents] if p.exists())
        try:
            with tempfile.TemporaryDirectory(dir=existing, prefix=".rlship-check-"):
                pass  # made and removed: what the run would make there can be made
        except OSError as exc:
            return Check(
                "output dir",
                False,
                f"output_dir={str(path)!r} cannot be made in {existing} ({exc.strerror or exc})",
                "choose another --output-dir or fix its permissions",
            )
        return Check("output dir", True, f"{path} is writable" if existing == path else f"{path} can be made")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".rlship-check-"):
            pass
    except OSError as exc:
        return Check(
            "output dir",
            False,
            f"output_dir={str(path)!r} is not writable ({exc.strerror or exc})",
            "choose another --output-dir or fix its permissions",
        )
    return Check("output dir", True, f"{path} is writable")


def rank_in_run(rank: int, ranks: int) -> Check:
    if 0 <= rank < ranks:
        return Check("rank", True, f"rank {rank} of {ranks}")
    return Check("rank", False, f"--rank {rank} is not a rank of this run (ranks={ranks}: 0 to {ranks - 1})",
                 "give --rank from 0 to ranks - 1, and --ranks the run's number of ranks")  # fmt: skip


def workers_on_queues(settings: RunSettings) -> list[Check]:
    """Workers answering on the run's queues: any number on `cpu`, exactly one on `ship`."""
    consumers = queue_consumers(settings.redis_url, [settings.cpu_queue, settings.ship_queue])
    checks = []
    wanted = {settings.cpu_queue: "one or more", settings.ship_queue: "exactly one (-c 1)"}
    for queue in wanted:
        workers = consumers[queue]
        ok = bool(workers) and (queue == settings.cpu_queue or len(workers) == 1)
        detail = f"queue {queue!r}: {len(workers)} worker(s) answering {workers if workers else ''}".rstrip()
        fix = f"start {wanted[queue]}: celery -A tasks worker -Q {queue}"
        checks.append(Check("workers", ok, detail, fix + " (`rlship run` starts its own)", fatal=False))
    return checks


def doctor_checks(settings: RunSettings) -> list[Check]:
    """Everything `rlship doctor` looks at, fatal for a run or not."""
    answer = probe_redis(settings.redis_url)
    if answer.reason == "unreachable":
        checks = [answer.check, redis_can_be_started(settings.redis_url)]
    else:
        checks = redis_checks(settings, answer)
    if settings.transport == "zmq":
        checks.append(port_pair_free(settings.zmq_host, settings.zmq_port))
    if settings.metrics_port:
        checks.append(metrics_port_free(settings.metrics_host, settings.metrics_port))
    checks.append(output_dir_writable(Path(settings.output_dir), create=False))
    if answer.client is not None:
        checks.append(ports_of_live_runs(answer.client))
        checks += workers_on_queues(settings)
    return checks


# -- what each command needs ----------------------------------------------------------------


def preflight_run(settings: RunSettings, *, port_movable: bool = False) -> list[Check]:
    """`rlship run`: everything it will need on this machine, before it starts anything. A
    ZMQ port it may move (`port_movable`: left at its default, rlship's own trainer ranks)
    is checked when the run claims it instead (commands/run.py, `claim_ship_ports`)."""
    answer = probe_redis(settings.redis_url)
    checks = [output_dir_writable(Path(settings.output_dir))]
    if answer.reason == "unreachable":
        checks.append(redis_can_be_started(settings.redis_url))
    else:
        checks += redis_checks(settings, answer)
    if answer.client is not None:
        checks.append(run_id_free(answer.client, settings.run_id))
    if settings.transport == "zmq" and not port_movable:
        claimed = ports_unclaimed(answer.client, settings) if answer.client is not None else None
        # One line for one taken port: the run holding it, or else what cannot be bound.
        checks.append(
            claimed if claimed and not claimed.ok else port_pair_free(settings.zmq_host, settings.zmq_port)
        )
    if settings.metrics_port:
        checks.append(metrics_port_free(settings.metrics_host, settings.metrics_port))
    return require("run", checks)


def preflight_client(command: str, settings: RunSettings, *, unfinished_run: bool = False) -> redis.Redis:
    """`orchestrate`, `produce`, `trainer`: a Redis that answers (given a few seconds), with
    the password and database right, and (`unfinished_run`, for the orchestrator) a run id
    not used by a finished run; returns the probing client."""
    answer = wait_for_redis(settings.redis_url)
    checks = redis_checks(settings, answer, replicas_fatal=False)
    if answer.client is not None and unfinished_run:
        checks.append(run_id_free(answer.client, settings.run_id))
    require(command, checks)
    assert answer.client is not None
    return answer.client
