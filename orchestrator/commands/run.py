"""`rlship run`: the whole system on one machine.

Starts (or connects to) Redis, the Celery workers, the trainer ranks, the producer and
the orchestrator as child processes (their output in `{output_dir}/logs/`); prints one
line per shipped step and the run's live status (`orchestrator.commands.progress`); stops
everything after `--steps N` (or Ctrl-C) and prints a summary (also written as JSON with
`--summary-json`). `rlship orchestrate` and `rlship trainer` are the children's commands.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis

from orchestrator.commands.checks import port_pair_free, preflight_run
from orchestrator.commands.processes import (
    ProcessGroup,
    delete_queues,
    ensure_redis,
    rlship_command,
    worker_commands,
)
from orchestrator.commands.progress import REFRESH_SECONDS, ProgressDisplay
from orchestrator.logs import configure_logging
from orchestrator.resume import ResumeRefused, StoredRun, check_steps_left, given_again, resumed
from orchestrator.settings import RunSettings, run_queue, settings_to_env
from orchestrator.settings_resolution import (
    RUN_DEFAULTS,
    add_settings_arguments,
    resolve_settings,
    run_defaults,
)
from orchestrator.status_reader import StatusReader
from tasks.logs import mask_secrets
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.port_claims import claim_call, claim_holder, release_call
from transport.store import DEFAULT_TTL_SECONDS, PayloadStore
from transport.zmq_sockets import free_port_pair

log = logging.getLogger("rlship.run")

TRAINER_DRAIN_SECONDS = 60.0
RESTARTABLE = frozenset({"redis", "cpu-worker", "ship-worker"})
QUEUE_DRAIN_SECONDS = 5.0
KEYS_KEPT_SECONDS = DEFAULT_TTL_SECONDS
MAX_RESTARTS = 10
# The claim of the run's port pair outlives `rlship run`'s start-up by this much; its
# orchestrator renews it from its start (orchestrator.lease).
PORT_CLAIM_SECONDS = 60
PORT_PAIR_TRIES = 20


def received_by_rank(client: redis.Redis, run_id: str, ranks: int) -> dict[str, dict[str, Any]]:
    """What each trainer rank recorded as received: its steps in order, their checksums, and
    the checksums of the side-array rows it read by handle (by step)."""
    keys = RunKeys(run_id)
    out = {}
    for rank in range(ranks):
        received = {int(k): v.decode() for k, v in client.hgetall(keys.received(rank)).items()}
        steps = sorted(received)
        rows = {k.decode(): v.decode() for k, v in client.hgetall(keys.received_rows(rank)).items()}
        out[str(rank)] = {"steps": steps, "checksums": [received[s] for s in steps], "rows_checksums": rows}
    return out


def sent_checksums(client: redis.Redis, run_id: str, key: str | None = None) -> dict[str, str]:
    """`{step}:{rank}` to the checksum encode wrote: of the payload, or of another hash (`key`)."""
    return {k.decode(): v.decode() for k, v in client.hgetall(key or RunKeys(run_id).sent_checksums).items()}


def _wait_for_trainers(group: ProcessGroup, ranks: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for rank in range(ranks):
        process = group.processes.get(f"trainer-{rank}")
        if process is not None:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except Exception:
                log.warning("trainer rank %d did not finish in time", rank)


class ChildFailed(RuntimeError):
    """A child of the run exited and cannot be started again."""


class PortsTaken(RuntimeError):
    """The run's ZMQ port pair is another run's or another process's, and may not move."""


def _pair_taken(client: redis.Redis, run_id: str, host: str, port: int) -> str | None:
    """Claim `host:port` and the port after it for the run; why they are not the run's to
    use (another live run of this Redis holds the claim, a process has bound one), or None."""
    holder = claim_holder(client.eval(*claim_call(run_id, host, port, PORT_CLAIM_SECONDS)))
    if holder is not None:
        return f"is held by live run {holder} of this Redis"
    check = port_pair_free(host, port)
    if check.ok:
        return None
    client.eval(*release_call(run_id, host, port))
    return f"cannot be bound: {check.detail}"


def claim_ship_ports(client: redis.Redis, settings: RunSettings, movable: bool) -> RunSettings:
    """Claim the run's ZMQ port pair before anything starts (transport.port_claims), so a
    rank of this run never connects to another run's sender. A pair another live run of
    this Redis holds, or another process has bound, stops the run in one line; `movable`
    (the port left at its default, the run's own trainer ranks, which are told the port)
    takes a free pair instead, and says so."""
    if settings.transport != "zmq":
        return settings
    host, port = settings.zmq_host, settings.zmq_port
    problem = _pair_taken(client, settings.run_id, host, port)
    if problem is None:
        return settings
    if not movable:
        raise PortsTaken(
            f"zmq_port {host}:{port} (or the READY port {port + 1}) {problem}: choose another --zmq-port"
        )
    for _ in range(PORT_PAIR_TRIES):
        candidate = free_port_pair(host)
        if _pair_taken(client, settings.run_id, host, candidate) is None:
            print(
                f"rlship run {settings.run_id}: the default zmq_port {host}:{port} {problem}; this run "
                f"ships on {candidate} and {candidate + 1} (its trainer ranks are told)"
            )
            return settings.with_changes(zmq_port=candidate)
    raise PortsTaken(
        f"zmq_port {host}:{port} {problem}, and no free pair was found in {PORT_PAIR_TRIES} tries"
    )


def release_ship_ports(client: redis.Redis, settings: RunSettings) -> None:
    if settings.transport == "zmq":
        client.eval(*release_call(settings.run_id, settings.zmq_host, settings.zmq_port))


def own_queues(settings: RunSettings) -> list[str]:
    """The run's queues that are its own (not named by an operator to share a pool)."""
    queues = [(settings.cpu_queue, "cpu"), (settings.ship_queue, "ship")]
    return [queue for queue, kind in queues if queue == run_queue(settings.run_id, kind)]


def run_local(
    settings: RunSettings, summary_path: Path | None, *, port_movable: bool = False
) -> dict[str, Any]:
    # The children run in the repository (`ProcessGroup`): a relative path would be theirs.
    given = {
        name: Path(path).resolve()
        for name in ("record_rollouts", "broadcast_dir")
        if name in settings.model_fields_set and (path := getattr(settings, name)) is not None
    }
    # A derived broadcast_dir follows the resolved output_dir.
    settings = settings.with_changes(output_dir=Path(settings.output_dir).resolve(), **given)
    output_dir = Path(settings.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup(env=settings_to_env(settings), log_dir=output_dir / "logs")
    started = time.perf_counter()
    started_at = time.time()  # the run's time: from here to the end of its shipping (`run_seconds`)
    orchestrator_summary = output_dir / "orchestrator-summary.json"
    orchestrator_summary.unlink(missing_ok=True)
    stopped = "done"
    client: redis.Redis | None = None
    try:
        if ensure_redis(settings.redis_url, group, output_dir / "redis"):
            print(
                f"rlship run {settings.run_id}: no Redis answered at {mask_secrets(settings.redis_url)}, "
                f"so this run started its own there (data in {output_dir / 'redis'}); it stops with the "
                "run, and `rlship status` sees the run only while it runs"
            )
        client = connect_redis(settings.redis_url, socket_timeout=5)
        settings = claim_ship_ports(client, settings, port_movable)
        group.env = settings_to_env(settings)
        status_key = RunKeys(settings.run_id).status
        client.hdel(status_key, "run_seconds")  # an earlier start's; this one's is written at its end
        shipped_before = int(client.hlen(RunKeys(settings.run_id).published))
        for name, command in worker_commands(settings).items():
            group.start(name, command)
        if settings.trainers == "builtin":
            for rank in range(settings.ranks):
                group.start(f"trainer-{rank}", rlship_command("trainer", "--rank", str(rank)))
        group.start("producer", rlship_command("produce"))
        display = ProgressDisplay(
            StatusReader(client, settings.run_id, [settings.cpu_queue, settings.ship_queue], settings.ranks),
            sys.stdout,
            settings.steps,
            settings.ranks,
            elapsed=time.time() - started_at,
        )
        orchestrator = group.start(
            "orchestrator", rlship_command("orchestrate", "--summary-out", str(orchestrator_summary))
        )
        try:
            while orchestrator.poll() is None:
                _restart_or_fail(group)
                display.update()
                time.sleep(REFRESH_SECONDS)
            if orchestrator.returncode != 0:
                cause = _orchestrator_error(group.log_dir / "orchestrator.log")
                stopped = (
                    f"the orchestrator exited with {orchestrator.returncode}{cause} "
                    f"(log in {group.log_dir / 'orchestrator.log'})"
                )
            else:
                _wait_for_trainers(group, settings.ranks, TRAINER_DRAIN_SECONDS)
        except KeyboardInterrupt:
            stopped = "interrupted (Ctrl-C or SIGTERM)"
        except ChildFailed as exc:
            stopped = str(exc)
        group.stop("orchestrator")
        # The run's one orchestrator (a second start of a running run is refused) is gone, even
        # if a Ctrl-C ended it before it let go of its lease: a resume must not wait that out.
        client.delete(RunKeys(settings.run_id).orchestrator_lease)
        run_seconds = time.time() - started_at
        client.hset(status_key, "run_seconds", run_seconds)
        # Every step published, however the run stopped (Ctrl-C too), and the run's time.
        display.update(status=True, elapsed=run_seconds)
        _end_tasks(client, settings)
        for name in [n for n in reversed(list(group.processes)) if n != "redis"]:
            group.stop(name)
        delete_queues(client, own_queues(settings))
        summary = _summarize(settings, orchestrator_summary, stopped, shipped_before)
        summary["run_seconds"] = run_seconds
        store = PayloadStore(client, settings.run_id)
        if stopped == "done":
            # The producer stopped after the orchestrator: what it wrote since goes too.
            store.delete_all_rollouts()
            settings.run_rows().remove_all()
        store.expire_run(KEYS_KEPT_SECONDS)
    finally:
        if client is not None:
            with contextlib.suppress(redis.RedisError):
                release_ship_ports(client, settings)
        group.stop_all()
    summary.update({"wall_seconds": time.perf_counter() - started})
    if summary_path is not None:
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def _orchestrator_error(log_path: Path) -> str:
    """`: {cause}` from the orchestrator's last error line (`rlship orchestrate: ...`), if any."""
    prefix = "rlship orchestrate: "
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    causes = [line.removeprefix(prefix) for line in lines if line.startswith(prefix)]
    return f": {causes[-1]}" if causes else ""


def _end_tasks(client: redis.Redis, settings: RunSettings) -> None:
    """The orchestrator has stopped: end the run's tasks. Without the alive mark a worker
    drops each task of the run it takes; give the workers a few seconds to take what is
    queued (the queues may be shared with other runs, so this wait is bounded)."""
    client.unlink(RunKeys(settings.run_id).alive)
    deadline = time.monotonic() + QUEUE_DRAIN_SECONDS
    queues = (settings.cpu_queue, settings.ship_queue)
    while time.monotonic() < deadline and any(client.llen(queue) for queue in queues):
        time.sleep(0.1)


def _restart_or_fail(group: ProcessGroup) -> None:
    """Workers hold no state and the run's own Redis keeps an append-only file: when one
    exits (a worker's consumer can die when Redis restarts under it), start it again.
    Any other child exiting, or one restarting too often, ends the run."""
    exited = {
        name: process.returncode
        for name, process in group.processes.items()
        if name in RESTARTABLE and process.poll() is not None
    }
    for name, code in {**group.failed(), **exited}.items():
        if name == "orchestrator":
            continue
        restarts = group.restarts.get(name, 0)
        if name not in RESTARTABLE or restarts >= MAX_RESTARTS:
            raise ChildFailed(f"{name} exited with {code} (log in {group.log_dir / (name + '.log')})")
        log.warning("%s exited with %s; starting it again (restart %d)", name, code, restarts + 1)
        group.restart(name)


def _summarize(
    settings: RunSettings, orchestrator_summary: Path, stopped: str, shipped_before: int
) -> dict[str, Any]:
    """What the run shipped, from Redis (the one source whatever stopped the run): a step is
    shipped when its record is published, which needs every rank's send first."""
    client = connect_redis(settings.redis_url)
    shipped = int(client.hlen(RunKeys(settings.run_id).published))
    summary: dict[str, Any] = {"run_id": settings.run_id}
    if orchestrator_summary.exists():
        summary.update(json.loads(orchestrator_summary.read_text()))
    stream = client.xrange(RunKeys(settings.run_id).metrics_stream)  # the last RECORDS_KEPT
    records = [json.loads(fields[b"record"]) for _, fields in stream]
    lag_ms = [record.get("event_loop_lag/max_ms", 0.0) for record in records]
    summary.update(
        {
            "tokens_shipped": int(records[-1]["progress/total_tokens"]) if records else 0,
            "loop_lag_max_ms": max([summary.get("loop_lag_max_ms", 0.0), *lag_ms]),
            "steps_wanted": settings.steps,
            "steps_shipped": shipped,
            "steps_shipped_before": shipped_before,
            "stopped": stopped,
            "ranks": received_by_rank(client, settings.run_id, settings.ranks),
            "sent_checksums": sent_checksums(client, settings.run_id),
            "sent_rows_checksums": sent_checksums(
                client, settings.run_id, RunKeys(settings.run_id).sent_rows_checksums
            ),
            "tasks_dropped": _counts(client, RunKeys(settings.run_id).tasks_dropped),
            "served_by": _counts(client, RunKeys(settings.run_id).served_by),
            "foreign_dropped": _counts(client, RunKeys(settings.run_id).foreign_dropped),
            "zmq_port": settings.zmq_port if settings.transport == "zmq" else None,
        }
    )
    return summary


def _counts(client: redis.Redis, key: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(key).items()}


def resume_with_run_settings(settings: RunSettings, sources: Mapping[str, str]) -> RunSettings:
    """A run id given again resumes that run with its own settings (orchestrator.resume),
    the ones given again applied where they may change, and says so in one line. A run
    Redis does not know (or no Redis yet) starts as given; a finished one is refused by the
    preflight checks, a running one here."""
    if sources["run_id"] == "default":
        return settings
    try:
        client = connect_redis(
            settings.redis_url, ride_out_outages=False, socket_connect_timeout=2, socket_timeout=5
        )
        run = StoredRun.read(client, settings.run_id)
    except (redis.RedisError, OSError):
        return settings
    if run is None or run.finished:
        return settings
    if run.running:
        raise ResumeRefused(
            f"run {settings.run_id} is running now (its orchestrator holds the lease): stop it before "
            "resuming it, or choose another --run-id"
        )
    settings, changes = resumed(run.settings, settings, given_again(sources))
    check_steps_left(settings, run.shipped)
    changed = ", ".join(f"{name} {change}" for name, change in changes.items())
    print(
        f"rlship run {settings.run_id}: resuming with the run's settings, {run.shipped} of "
        f"{steps(settings.steps)} shipped" + (f"; given again: {changed}" if changed else "")
    )
    return settings


def steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def print_summary(summary: dict[str, Any]) -> None:
    run_id = summary["run_id"]
    before = summary.get("steps_shipped_before", 0)
    resumed = f", {before} of them before this start" if before else ""
    print(
        f"\nrlship run {run_id}: {steps(summary['steps_shipped'])} shipped{resumed}, "
        f"{summary.get('tokens_shipped', 0):,} tokens in "
        f"{summary['run_seconds']:.1f} s; event-loop lag max {summary.get('loop_lag_max_ms', 0.0):.1f} ms"
    )
    for rank, received in sorted(summary.get("ranks", {}).items()):
        print(f"  rank {rank}: received steps {received['steps']}")
    for rank, dropped in sorted(summary.get("foreign_dropped", {}).items()):
        print(f"  rank {rank}: dropped {dropped} steps of another run (pointed at another run's port)")
    if summary.get("tasks_dropped"):
        print(f"  tasks dropped after the run ended (not retried): {summary['tasks_dropped']}")
    if summary["stopped"] != "done":
        print(
            f"  stopped: {summary['stopped']}, {summary['steps_wanted'] - summary['steps_shipped']} of "
            f"{summary['steps_wanted']} steps not shipped; the run's keys expire in "
            f"{KEYS_KEPT_SECONDS // 3600} h: `rlship run --run-id {run_id}` resumes it with its settings"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, RUN_DEFAULTS)
    parser.add_argument("--summary-json", type=Path, default=None, help="write the summary here")


def interrupt_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM stops the run as Ctrl-C does: children stopped by PID, summary printed."""
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    resolved = resolve_settings(args)
    try:
        settings = resume_with_run_settings(run_defaults(resolved), resolved.sources)
    except ResumeRefused as exc:
        print(f"rlship run: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_json, logging.INFO, run_id=settings.run_id)
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    # External trainers are configured with the port themselves: only rlship's may be moved.
    port_movable = resolved.sources["zmq_port"] == "default" and settings.trainers == "builtin"
    for check in preflight_run(settings, port_movable=port_movable):
        if not check.ok:
            log.warning("%s", check.line())
    try:
        summary = run_local(settings, args.summary_json, port_movable=port_movable)
    except KeyboardInterrupt:
        print(f"rlship run {settings.run_id}: interrupted while starting; what it started is stopped")
        return 130
    except PortsTaken as exc:
        print(f"rlship run {settings.run_id}: {exc}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 0 if summary.get("steps_shipped", 0) == settings.steps else 1
