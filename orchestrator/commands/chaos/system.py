"""One run of the whole system for `rlship chaos`: the workload written up front, the
workers, trainer ranks and orchestrator as processes (started again when killed, as a
supervisor would), and what the trainer ranks received."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from orchestrator.acl import acl_rules, role_user, roles_with_users
from orchestrator.commands.chaos.kills import Kill, KillPlan, kill_one
from orchestrator.commands.processes import (
    SOURCE_ROOT,
    ProcessGroup,
    rlship_command,
    wait_for_workers,
    worker_commands,
)
from orchestrator.commands.produce import SyntheticWorkload
from orchestrator.commands.run_report import orchestrator_error
from orchestrator.groups import TRAINABLE, decide_group
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings, settings_to_env
from tasks.faults import fault_field
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.store import PayloadStore

WORKERS = ("cpu-worker", "ship-worker")
STOCK_PEERS = SOURCE_ROOT / "tests" / "support" / "stock_peers.py"
HANG_SECONDS = 30.0  # after the run, how long a stock rank may take to get its last step


class RunFailed(RuntimeError):
    """A run of the system that could not finish: why, and where its logs are."""


def write_workload(settings: RunSettings) -> int:
    """Write whole groups until they hold enough trainable rollouts for every step (plus
    one batch); the fates are decided here exactly as the orchestrator will decide them."""
    client = connect_redis(settings.for_role("producer").redis_url)  # as its user, if it has one
    producer = RolloutProducer.for_run(client, settings, admitted=False)  # written up front
    workload = SyntheticWorkload.for_run(settings)
    needed = (settings.steps + 1) * settings.batch_size
    trainable = written = 0
    while trainable < needed:
        group = workload.group()
        producer.produce(group)
        outcomes = decide_group(
            [record for record, _ in group],
            settings.start_step,
            settings.max_off_policy_steps,
            first_step=settings.first_step,
        )
        trainable += sum(outcome.fate == TRAINABLE for outcome in outcomes)
        written += len(group)
    return written


def give_role_users(settings: RunSettings, plan: KillPlan) -> list[str]:
    """The run's users of the roles given one (`redis_{role}_auth`), made as `rlship acl`
    prints them for this run (its id, queues and ports: a chaos run's own), on every server
    of the run's Redis (ACL users are not replicated; a killed primary started again is given
    them too); their names. The command connects as REDIS_URL's user, who must be allowed
    ACL SETUSER."""
    roles = roles_with_users(settings)
    rules = [rule.split() for rule in acl_rules(settings, roles)]
    try:
        if plan.cluster is not None:
            plan.cluster.give_acl(rules)
        else:
            client = connect_redis(settings.redis_url)
            for rule in rules:
                client.execute_command(*rule)
    except redis.exceptions.NoPermissionError as exc:
        raise RunFailed(
            f"{settings.run_id}: REDIS_URL's user may not make the roles' users (ACL SETUSER): {exc}"
        ) from None
    return [role_user(settings, role).name for role in roles]


def take_role_users(settings: RunSettings, plan: KillPlan, users: list[str]) -> None:
    """The run's role users deleted from every server, once its processes have stopped."""
    if not users:
        return
    if plan.cluster is not None:
        plan.cluster.give_acl([])
    for client in plan.cluster.clients() if plan.cluster is not None else [connect_redis(settings.redis_url)]:
        client.acl_deluser(*users)


def trainer_command(settings: RunSettings, rank: int, receivers: str) -> list[str]:
    if receivers == "rlship":
        return rlship_command("trainer", "--rank", str(rank))
    if not STOCK_PEERS.exists():
        raise SystemExit(f"rlship chaos: --receivers stock needs a checkout ({STOCK_PEERS} is missing)")
    return [
        sys.executable, "-m", "tests.support.stock_peers", "zmq", "--rank", str(rank),
        "--record", str(stock_record(settings, rank)), "--output-dir", str(settings.output_dir),
        "--host", settings.zmq_host, "--port", str(settings.zmq_port),
        "--start-step", str(settings.start_step), "--wire", str(settings.wire),
    ]  # fmt: skip


def stock_record(settings: RunSettings, rank: int) -> Path:
    return settings.output_dir / "stock" / f"rank-{rank}.jsonl"


def run_system(
    settings: RunSettings,
    kill_every: float | None,
    rng: random.Random,
    timeout: float,
    receivers: str,
    plan: KillPlan,
) -> dict[str, Any]:
    """One run of the whole system on this machine, with kills when `kill_every` is set."""
    users = give_role_users(settings, plan)
    try:
        rollouts = write_workload(settings)
    except BaseException:
        take_role_users(settings, plan, users)
        raise
    group = ProcessGroup(
        env={**settings_to_env(settings), "RLSHIP_FAULTS": "1"}, log_dir=settings.output_dir / "logs"
    )
    client = connect_redis(settings.redis_url)
    kills: list[Kill] = []
    started = time.monotonic()
    try:
        for name, command in worker_commands(settings).items():
            group.start(name, command)
        wait_for_workers(settings, group)
        for rank in range(settings.ranks):
            group.start(f"trainer-{rank}", trainer_command(settings, rank, receivers))
        started = time.monotonic()
        group.start("orchestrator", rlship_command("orchestrate"))
        next_kill = started + (kill_every or 0.0)
        while True:
            code = group.processes["orchestrator"].poll()
            if code == 0:
                break
            if code is not None and code != -signal.SIGKILL:
                cause = orchestrator_error(group.log_dir / "orchestrator.log")
                raise RunFailed(
                    f"{settings.run_id}: the orchestrator exited with {code}{cause}; its logs are kept "
                    f"in {group.log_dir}"
                )
            # Restarted as a supervisor would: the orchestrator from this poll's code only (a
            # second poll could see the clean exit it has just made, and start a finished run).
            if code == -signal.SIGKILL:
                group.restart("orchestrator")
            for name in WORKERS:
                if group.processes[name].poll() is not None:
                    group.restart(name)
            now = time.monotonic()
            if now - started > timeout:
                raise RunFailed(f"{settings.run_id}: no end after {timeout:g} s; logs in {group.log_dir}")
            if kill_every is not None and now >= next_kill:
                kill = kill_one(settings, group, client, rng, kills, now - started, plan)
                if kill is not None:
                    kills.append(kill)
                next_kill = now + kill_every
            time.sleep(0.02)
        wall = time.monotonic() - started
        if receivers == "rlship":
            hung = wait_for_trainers(group, settings.ranks, 60)
            if hung:
                raise RunFailed(
                    f"{settings.run_id}: trainer ranks {hung} never finished; see {group.log_dir}"
                )
        else:
            hung = wait_for_stock_ranks(settings, HANG_SECONDS)
    finally:
        group.stop_all()
        take_role_users(settings, plan, users)
    fired = {f.decode() for f in client.hkeys(RunKeys(settings.run_id).faults)}
    for kill in kills:
        if kill.target == "stage-fault":
            kill.fired = fault_field(kill.stage, kill.step, kill.rank) not in fired
    seen = observe(settings, client) if receivers == "rlship" else observe_stock(settings, client)
    return {"rollouts_written": rollouts, "wall_seconds": wall, "kills": kills, "hung_ranks": hung, **seen}


def wait_for_trainers(group: ProcessGroup, ranks: int, timeout: float) -> list[int]:
    """The ranks still running `timeout` seconds from now (a stock rank waits forever for a
    step it lost)."""
    deadline = time.monotonic() + timeout
    for rank in range(ranks):
        with contextlib.suppress(subprocess.TimeoutExpired):
            group.processes[f"trainer-{rank}"].wait(max(0.0, deadline - time.monotonic()))
    return [rank for rank in range(ranks) if group.processes[f"trainer-{rank}"].poll() is None]


def wait_for_stock_ranks(settings: RunSettings, timeout: float) -> list[int]:
    """The stock ranks that, `timeout` seconds from now, have not recorded every step of the
    run. They read until stopped (a stock rank counts a duplicate as its next step, so one
    told to stop after N messages would stop a step early and hang the run)."""
    deadline = time.monotonic() + timeout
    wanted = set(settings.step_numbers)
    while True:
        hung = [rank for rank in range(settings.ranks) if not wanted <= stock_topic_steps(settings, rank)]
        if not hung or time.monotonic() > deadline:
            return hung
        time.sleep(0.1)


def stock_topic_steps(settings: RunSettings, rank: int) -> set[int]:
    path = stock_record(settings, rank)
    lines = path.read_text().splitlines() if path.exists() else []
    return {json.loads(line)["topic_step"] for line in lines if line.endswith("}")}


def observe(settings: RunSettings, client: redis.Redis) -> dict[str, Any]:
    """What the trainer ranks received, the records published and what Redis still holds."""
    keys = RunKeys(settings.run_id)
    ranks: dict[str, Any] = {}
    for rank in range(settings.ranks):
        ranks[str(rank)] = {
            "checksums": {k.decode(): v.decode() for k, v in client.hgetall(keys.received(rank)).items()},
            "deliveries": {k.decode(): int(v) for k, v in client.hgetall(keys.deliveries(rank)).items()},
            "order": [int(s) for s in client.lrange(keys.delivery_order(rank), 0, -1)],
            "rows": {k.decode(): v.decode() for k, v in client.hgetall(keys.received_rows(rank)).items()},
        }
    records = [int(fields[b"step"]) for _, fields in client.xrange(keys.metrics_stream)]
    left = PayloadStore(client, settings.run_id).held_keys()
    sent = {k.decode(): v.decode() for k, v in client.hgetall(keys.sent_checksums).items()}
    files = [str(p) for d in _run_directories(settings) if d.exists() for p in d.rglob("*") if p.is_file()]
    return {"ranks": ranks, "records": records, "keys_left": left, "sent": sent, "files_left": files}


def _run_directories(settings: RunSettings) -> list[Path]:
    """The run's own directories of rows files and retained payloads: empty once it ends."""
    directory = settings.payload_directory()
    return [settings.run_rows().directory, *([directory.root] if directory is not None else [])]


def observe_stock(settings: RunSettings, client: redis.Redis) -> dict[str, Any]:
    """What stock ranks recorded (by the step in the topic, which they ignore), in the
    shape `observe` gives, and the sends redone after an interrupted one."""
    ranks: dict[str, Any] = {}
    for rank in range(settings.ranks):
        path = stock_record(settings, rank)
        got = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        ranks[str(rank)] = {
            "checksums": {str(r["topic_step"]): r["xxh3_128"] for r in got},
            "deliveries": {str(s): n for s, n in Counter(r["topic_step"] for r in got).items()},
            "order": [r["topic_step"] for r in got],
            # What a stock rank read by handle: a digest of its steps' rows by trace id.
            "rows": {
                str(r["topic_step"]): json.dumps(r["rows"], sort_keys=True) for r in got if r.get("rows")
            },
        }
    seen = observe(settings, client)
    interrupted = client.hgetall(RunKeys(settings.run_id).interrupted_sends)
    return {
        **seen,
        "ranks": ranks,
        "interrupted_sends": {k.decode(): int(v) for k, v in interrupted.items()},
    }
