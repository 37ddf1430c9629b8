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
from orchestrator.commands.run_report import (
    KEYS_KEPT_SECONDS,
    orchestrator_error,
    print_summary,
    steps,
    summarize,
)
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
from tasks import tracing
from tasks.logs import mask_secrets
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.port_claims import claim_call, claim_holder, release_call
from transport.run_files import restrict
from transport.store import PayloadStore
from transport.zmq_curve import make_keys
from transport.zmq_sockets import free_port_pair

log = logging.getLogger("rlship.run")

TRAINER_DRAIN_SECONDS = 60.0
RESTARTABLE = frozenset({"redis", "cpu-worker", "ship-worker"})
QUEUE_DRAIN_SECONDS = 5.0
MAX_RESTARTS = 10
# The claim of the run's port pair outlives `rlship run`'s start-up by this much; its
# orchestrator renews it from its start (orchestrator.lease).
PORT_CLAIM_SECONDS = 60
PORT_PAIR_TRIES = 20
INTERRUPTED = "interrupted"  # by a signal (`StopSignals`): the summary says which, and where the run was


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


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM ask `rlship run` to stop: noted, never raised, so that the
    stop runs whole whatever it was doing when one came (a second one changes nothing)."""

    def __init__(self) -> None:
        self.received: str | None = None
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.received = self.received or signal.Signals(signum).name


def run_local(
    settings: RunSettings, summary_path: Path | None, stop: StopSignals, *, port_movable: bool = False
) -> dict[str, Any] | None:
    """The run, from start to summary; None if stopped before a Redis answered (nothing of
    the run is in Redis to report, and what was started is stopped)."""
    # The children run in the repository (`ProcessGroup`): a relative path would be theirs.
    given = {
        name: Path(path).resolve()
        for name in ("record_rollouts", "broadcast_dir", "zmq_keys_dir")
        if name in settings.model_fields_set and (path := getattr(settings, name)) is not None
    }
    # A derived broadcast_dir follows the resolved output_dir.
    settings = settings.with_changes(output_dir=Path(settings.output_dir).resolve(), **given)
    output_dir = Path(settings.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if settings.zmq_curve and settings.transport == "zmq":
        keys_dir = Path(str(settings.zmq_keys_dir))
        made = [name for name, fresh in make_keys(keys_dir, settings.ranks) if fresh]
        if made:
            print(f"rlship run {settings.run_id}: made CURVE keys {', '.join(made)} in {keys_dir}")
    group = ProcessGroup(env=settings_to_env(settings), log_dir=output_dir / "logs")
    started = time.perf_counter()
    started_at = time.time()  # the run's time: from here to the end of its shipping (`run_seconds`)
    orchestrator_summary = output_dir / "orchestrator-summary.json"
    orchestrator_summary.unlink(missing_ok=True)
    client: redis.Redis | None = None
    try:
        if ensure_redis(settings.redis_url, group, output_dir / "redis"):
            print(
                f"rlship run {settings.run_id}: no Redis answered at {mask_secrets(settings.redis_url)}, "
                f"so this run started its own there (data in {output_dir / 'redis'}); it stops with the "
                "run, and `rlship status` sees the run only while it runs"
            )
        if stop.received:
            return None
        client = connect_redis(settings.redis_url, socket_timeout=5)
        settings = claim_ship_ports(client, settings, port_movable)
        group.env = settings_to_env(settings)
        status_key = RunKeys(settings.run_id).status
        client.hdel(status_key, "run_seconds")  # an earlier start's; this one's is written at its end
        shipped_before = int(client.hlen(RunKeys(settings.run_id).published))
        display = ProgressDisplay(
            StatusReader(client, settings.run_id, [settings.cpu_queue, settings.ship_queue], settings.ranks),
            sys.stdout,
            settings.steps,
            settings.ranks,
            elapsed=time.time() - started_at,
        )
        stopped = _start_and_wait(group, settings, orchestrator_summary, display, stop)
        if stopped == INTERRUPTED:
            stopped = f"interrupted ({stop.received}) {_where(client, settings.run_id, started_at)}"
        group.stop("orchestrator")
        # The run's one orchestrator (a second start of a running run is refused) is gone, even
        # if a signal ended it before it let go of its lease: a resume must not wait that out.
        client.delete(RunKeys(settings.run_id).orchestrator_lease)
        run_seconds = time.time() - started_at
        client.hset(status_key, "run_seconds", run_seconds)
        # The steps published so far, however the run stopped (Ctrl-C too), and the run's time.
        display.update(status=True, elapsed=run_seconds)
        _end_tasks(client, settings)
        for name in [n for n in reversed(list(group.processes)) if n != "redis"]:
            group.stop(name)
        display.update(elapsed=run_seconds)  # a step a worker published as the run stopped
        delete_queues(client, own_queues(settings))
        summary = summarize(client, settings, orchestrator_summary, stopped, shipped_before)
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
    summary["wall_seconds"] = time.perf_counter() - started
    if summary_path is not None:
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def _start_and_wait(
    group: ProcessGroup,
    settings: RunSettings,
    orchestrator_summary: Path,
    display: ProgressDisplay,
    stop: StopSignals,
) -> str:
    """Start the run's children, the orchestrator last, and follow the run until it ends,
    a child fails or a signal stops it (`INTERRUPTED`); what stopped it (`done`: it
    shipped every step)."""
    children = {
        **worker_commands(settings),
        **{
            f"trainer-{rank}": rlship_command("trainer", "--rank", str(rank))
            for rank in range(settings.ranks if settings.trainers == "builtin" else 0)
        },
        "producer": rlship_command("produce"),
        "orchestrator": rlship_command("orchestrate", "--summary-out", str(orchestrator_summary)),
    }
    for name, command in children.items():
        if stop.received:
            return INTERRUPTED
        group.start(name, command)
    orchestrator = group.processes["orchestrator"]
    try:
        while orchestrator.poll() is None and not stop.received:
            _restart_or_fail(group)
            display.update()
            time.sleep(REFRESH_SECONDS)
    except ChildFailed as exc:
        return str(exc)
    if stop.received:
        return INTERRUPTED
    if orchestrator.returncode != 0:
        cause = orchestrator_error(group.log_dir / "orchestrator.log")
        return (
            f"the orchestrator exited with {orchestrator.returncode}{cause} "
            f"(log in {group.log_dir / 'orchestrator.log'})"
        )
    _wait_for_trainers(group, settings.ranks, TRAINER_DRAIN_SECONDS)
    return "done"


def _where(client: redis.Redis, run_id: str, started_at: float) -> str:
    """Where a run interrupted was: running once this start's orchestrator has written its
    status (it holds the run and cuts steps), starting before."""
    updated = client.hget(RunKeys(run_id).status, "updated_at")
    return "while running" if updated is not None and float(updated) >= started_at else "while starting"


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, RUN_DEFAULTS)
    parser.add_argument("--summary-json", type=Path, default=None, help="write the summary here")


def main(args: argparse.Namespace) -> int:
    stop = StopSignals()
    # Tracing asked for (OTEL_EXPORTER_OTLP_ENDPOINT) must work in every process the run starts.
    if (problem := tracing.problem()) is not None:
        print(f"rlship run: {problem}", file=sys.stderr)
        return 2
    resolved = resolve_settings(args)
    try:
        settings = resume_with_run_settings(run_defaults(resolved), resolved.sources)
    except ResumeRefused as exc:
        print(f"rlship run: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_json, logging.INFO, run_id=settings.run_id)
    restrict(settings.file_mode)  # its children (Redis, workers, producer, ...) inherit it
    # External trainers are configured with the port themselves: only rlship's may be moved.
    port_movable = resolved.sources["zmq_port"] == "default" and settings.trainers == "builtin"
    for check in preflight_run(settings, port_movable=port_movable):
        if not check.ok:
            log.warning("%s", check.line())
    try:
        summary = run_local(settings, args.summary_json, stop, port_movable=port_movable)
    except PortsTaken as exc:
        print(f"rlship run {settings.run_id}: {exc}", file=sys.stderr)
        return 2
    if summary is None:
        print(f"rlship run {settings.run_id}: interrupted ({stop.received}) before Redis answered")
        return 130
    print_summary(summary)
    return 0 if summary.get("steps_shipped", 0) == settings.steps else 1
