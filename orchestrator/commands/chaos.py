"""`rlship chaos`: the whole system shipping a seeded workload while its processes are
killed, compared with a fault-free run of the same workload.

Both runs ship the same rollouts, written up front in the same order (all on policy), so
every step's payloads are byte-identical in a correct run whatever dies. During the chaos
run, every `--kill-every` seconds one process dies by SIGKILL, in rotation:

- a stage fault: the worker that runs a chosen stage of an upcoming step kills itself at
  the worst moment of it (output written, completion not yet marked; `tasks.faults`),
  the stage chosen at random among all eight;
- a random pool process of the cpu worker, whatever it is doing;
- once, the whole ship worker (the process that owns the ZMQ sockets), and once the
  orchestrator, both mid-run; both are started again, as a supervisor would.

The report counts what the trainer ranks received: steps per rank, duplicates, steps out
of order, payloads that differ from the fault-free run, records published, keys left in
Redis, and the kills (`--json PATH`).

`--receivers stock` runs trainer ranks that receive as prime-rl's stock ones do
(tests/support/stock_peers.py, from a checkout): READY once, no duplicate check, no replay, their
own step count; what they got is read from their record files. A duplicate or a lost step
reaches such a rank for good, so this mode also reports ranks that never got every step
(`hung_ranks`, waited for 30 s after the run) and the sends a ship worker redid after a
predecessor died mid-send (`interrupted_sends`: each is a duplicate only if that process
died in the window between the message leaving it and its `last_sent` mark, tasks/ship.py).
The `send` stage fault fires inside that window by construction, so this mode leaves it
out of the rotation; the ship worker is killed `--ship-kills` times at random moments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import redis

from orchestrator.commands.processes import (
    SOURCE_ROOT,
    ProcessGroup,
    delete_run_keys,
    rlship_command,
    wait_for_workers,
    worker_commands,
)
from orchestrator.commands.produce import SyntheticWorkload
from orchestrator.groups import TRAINABLE, decide_group
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings, settings_to_env
from tasks.faults import arm, fault_field
from tasks.graph import PER_RANK_STAGES, STAGE_NAMES
from transport.keys import RunKeys
from transport.store import PayloadStore
from transport.zmq_sockets import free_port_pair

STOCK_STAGES = tuple(stage for stage in STAGE_NAMES if stage != "send")  # see the module docstring
WORKERS = ("cpu-worker", "ship-worker")
STOCK_PEERS = SOURCE_ROOT / "tests" / "support" / "stock_peers.py"
HANG_SECONDS = 30.0  # after the run, how long a stock rank may take to get its last step


@dataclass(frozen=True)
class KillPlan:
    ship_kills: int
    stages: tuple[str, ...]


@dataclass
class Kill:
    seconds: float  # since the chaos run started
    target: str  # stage-fault, cpu-worker-child, ship-worker, orchestrator
    stage: str | None = None
    step: int | None = None
    rank: int | None = None
    fired: bool = True  # a stage fault fires when its stage runs; checked at the end


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-every", type=float, default=1.0, help="seconds between kills")
    parser.add_argument("--json", type=Path, default=Path("runs/chaos/chaos.json"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take")
    parser.add_argument(
        "--receivers",
        choices=("rlship", "stock"),
        default="rlship",
        help="trainer ranks: rlship's, or ones that receive as prime-rl's stock receivers do",
    )
    parser.add_argument("--ship-kills", type=int, default=1, help="times the whole ship worker is killed")


def main(args: argparse.Namespace) -> int:
    base = RunSettings()  # REDIS_URL from the environment, as every rlship process reads it
    token = secrets.token_hex(3)
    out_dir = args.json.parent
    common = {
        "redis_url": base.redis_url,
        "steps": args.steps,
        "ranks": args.ranks,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "max_off_policy_steps": args.steps + 1,  # written up front, so never stale
        "stall_seconds": 5.0,
        "samples_per_step": 0,
        "trainers": "external" if args.receivers == "stock" else "builtin",
    }

    def settings_for(name: str) -> RunSettings:
        return RunSettings(
            **common,
            run_id=f"chaos-{name}-{token}",
            # Its own directory each time: an earlier invocation's stock-rank records and
            # policy broadcasts would otherwise be read as this one's.
            output_dir=(out_dir / f"{name}-{token}").resolve(),
            zmq_port=free_port_pair(),
            cpu_queue=f"chaos-cpu-{name}-{token}",
            ship_queue=f"chaos-ship-{name}-{token}",
        )

    reference, chaos = settings_for("reference"), settings_for("chaos")
    print(f"rlship chaos: fault-free run of {args.steps} steps ({reference.run_id})", flush=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that every child is stopped
    plan = KillPlan(args.ship_kills, STOCK_STAGES if args.receivers == "stock" else STAGE_NAMES)
    expected = run_system(reference, None, random.Random(args.seed), args.timeout, args.receivers, plan)
    print(f"rlship chaos: the same with a kill every {args.kill_every:g} s ({chaos.run_id})", flush=True)
    rng = random.Random(args.seed)
    observed = run_system(chaos, args.kill_every, rng, args.timeout, args.receivers, plan)
    report = compare(args, chaos.step_numbers, expected, observed)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print_report(report, args.json)
    for settings in (reference, chaos):
        delete_run_keys(settings)
    return 0 if report["goal_met"] else 1


def write_workload(settings: RunSettings) -> int:
    """Write whole groups until they hold enough trainable rollouts for every step (plus
    one batch); the fates are decided here exactly as the orchestrator will decide them."""
    client = redis.Redis.from_url(settings.redis_url)
    producer = RolloutProducer.for_run(client, settings, admitted=False)  # written up front
    workload = SyntheticWorkload(seed=settings.seed, group_size=settings.group_size, seq_len=settings.seq_len)
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


def _exit_on_sigterm(*_: object) -> None:
    raise SystemExit("rlship chaos: terminated")


def trainer_command(settings: RunSettings, rank: int, receivers: str) -> list[str]:
    if receivers == "rlship":
        return rlship_command("trainer", "--rank", str(rank))
    if not STOCK_PEERS.exists():
        raise SystemExit(f"rlship chaos: --receivers stock needs a checkout ({STOCK_PEERS} is missing)")
    return [
        sys.executable, "-m", "tests.support.stock_peers", "zmq", "--rank", str(rank),
        "--record", str(stock_record(settings, rank)), "--output-dir", str(settings.output_dir),
        "--host", settings.zmq_host, "--port", str(settings.zmq_port),
        "--start-step", str(settings.start_step),
    ]  # fmt: skip


def stock_record(settings: RunSettings, rank: int) -> Path:
    return settings.output_dir / "stock" / f"rank-{rank}.jsonl"


def run_system(
    settings: RunSettings,
    kill_every: float | None,
    rng: random.Random,
    timeout: float,
    receivers: str = "rlship",
    plan: KillPlan = KillPlan(1, STAGE_NAMES),
) -> dict[str, Any]:
    """One run of the whole system on this machine, with kills when `kill_every` is set."""
    rollouts = write_workload(settings)
    group = ProcessGroup(
        env={**settings_to_env(settings), "RLSHIP_FAULTS": "1"}, log_dir=settings.output_dir / "logs"
    )
    client = redis.Redis.from_url(settings.redis_url)
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
                raise RuntimeError(
                    f"{settings.run_id}: the orchestrator exited with {code}; logs in {group.log_dir}"
                )
            for name in (*WORKERS, "orchestrator"):  # as a supervisor would
                if group.processes[name].poll() is not None:
                    group.restart(name)
            now = time.monotonic()
            if now - started > timeout:
                raise RuntimeError(
                    f"{settings.run_id}: no end after {timeout:.0f} s; logs in {group.log_dir}"
                )
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
                raise RuntimeError(
                    f"{settings.run_id}: trainer ranks {hung} never finished; see {group.log_dir}"
                )
        else:
            hung = wait_for_stock_ranks(settings, HANG_SECONDS)
    finally:
        group.stop_all()
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


def kill_one(
    settings: RunSettings,
    group: ProcessGroup,
    client: redis.Redis,
    rng: random.Random,
    kills: list[Kill],
    seconds: float,
    plan: KillPlan = KillPlan(1, STAGE_NAMES),
) -> Kill | None:
    """The next kill of the rotation (module docstring). The orchestrator dies once it has
    published two steps; the ship worker once four are, and again every few steps after
    (`plan.ship_kills` in all), so both die mid-run."""
    published = client.hlen(RunKeys(settings.run_id).published)
    done = Counter(kill.target for kill in kills)
    if not done["orchestrator"] and published >= 2:
        group.processes["orchestrator"].send_signal(signal.SIGKILL)
        return Kill(seconds, "orchestrator", step=published)
    spacing = max(1, (settings.steps - 4) // max(1, plan.ship_kills))
    if done["ship-worker"] < plan.ship_kills and published >= 4 + spacing * done["ship-worker"]:
        children = _children(group, "ship-worker")  # before: once the parent dies they move
        group.processes["ship-worker"].send_signal(signal.SIGKILL)
        for child in children:
            child.kill()
        return Kill(seconds, "ship-worker", step=published)
    if len(kills) % 2 == 0:
        children = _children(group, "cpu-worker")
        if not children:
            return None
        rng.choice(children).kill()
        return Kill(seconds, "cpu-worker-child")
    step = int(client.get(RunKeys(settings.run_id).next_step) or settings.start_step)
    if step >= settings.step_numbers.stop:
        return None
    stage = rng.choice(plan.stages)
    rank = rng.randrange(settings.ranks) if stage in PER_RANK_STAGES else None
    if client.hexists(RunKeys(settings.run_id).faults, fault_field(stage, step, rank)):
        return None  # armed already: one fault per stage of a step
    arm(client, settings.run_id, stage, step, rank)
    return Kill(seconds, "stage-fault", stage, step, rank)


def _children(group: ProcessGroup, name: str) -> list[psutil.Process]:
    try:
        return psutil.Process(group.processes[name].pid).children()
    except psutil.NoSuchProcess:
        return []


def observe(settings: RunSettings, client: redis.Redis) -> dict[str, Any]:
    """What the trainer ranks received, the records published and what Redis still holds."""
    keys = RunKeys(settings.run_id)
    ranks: dict[str, Any] = {}
    for rank in range(settings.ranks):
        ranks[str(rank)] = {
            "checksums": {k.decode(): v.decode() for k, v in client.hgetall(keys.received(rank)).items()},
            "deliveries": {k.decode(): int(v) for k, v in client.hgetall(keys.deliveries(rank)).items()},
            "order": [int(s) for s in client.lrange(keys.delivery_order(rank), 0, -1)],
        }
    records = [int(fields[b"step"]) for _, fields in client.xrange(keys.metrics_stream)]
    left = PayloadStore(client, settings.run_id).held_keys()
    return {"ranks": ranks, "records": records, "keys_left": left}


def observe_stock(settings: RunSettings, client: redis.Redis) -> dict[str, Any]:
    """What stock ranks recorded (by the step in the topic, which they ignore), in the
    shape `observe` gives, and the sends redone after an interrupted one."""
    ranks: dict[str, Any] = {}
    for rank in range(settings.ranks):
        path = stock_record(settings, rank)
        got = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        ranks[str(rank)] = {
            "checksums": {str(r["topic_step"]): r["sha256"][:32] for r in got},
            "deliveries": {str(s): n for s, n in Counter(r["topic_step"] for r in got).items()},
            "order": [r["topic_step"] for r in got],
        }
    seen = observe(settings, client)
    interrupted = client.hgetall(RunKeys(settings.run_id).interrupted_sends)
    return {
        **seen,
        "ranks": ranks,
        "interrupted_sends": {k.decode(): int(v) for k, v in interrupted.items()},
    }


def compare(
    args: argparse.Namespace, step_numbers: range, expected: dict[str, Any], observed: dict[str, Any]
) -> dict[str, Any]:
    steps = [str(s) for s in step_numbers]
    delivered, duplicates, out_of_order, mismatches, in_window = {}, 0, 0, 0, 0
    # A send redone after a ship worker died between the message leaving and its mark (the
    # window README's Reliability states): the one way a stock rank gets a step twice.
    redone: dict[str, int] = observed.get("interrupted_sends", {})
    for rank, got in observed["ranks"].items():
        want = expected["ranks"][rank]["checksums"]
        delivered[rank] = sum(s in got["checksums"] for s in steps)
        duplicates += sum(n - 1 for n in got["deliveries"].values())
        in_window += sum(
            n - 1 for s, n in got["deliveries"].items() if redone.get(f"{s}:{rank}", 0) >= n - 1
        )
        out_of_order += sum(b <= a for a, b in zip(got["order"], got["order"][1:], strict=False))
        mismatches += sum(got["checksums"][s] != want.get(s) for s in got["checksums"])
    kills: list[Kill] = observed["kills"]
    effective = [k for k in kills if k.fired]
    report = {
        "steps_expected": args.steps,
        "steps_delivered_per_rank": delivered,
        "duplicates_delivered": duplicates,
        "duplicates_in_window": in_window,
        "out_of_order": out_of_order,
        "payload_mismatches": mismatches,
        "records_published": len(set(observed["records"])),
        "records_duplicated": len(observed["records"]) - len(set(observed["records"])),
        "keys_left": len(observed["keys_left"]),
        "kills": len(effective),
        "kills_by_target": dict(Counter(k.target for k in effective)),
        "kills_by_stage": dict(Counter(k.stage for k in effective if k.stage)),
        "kill_log": [asdict(k) for k in kills],
        "reference_keys_left": len(expected["keys_left"]),
        "wall_seconds": {"fault_free": expected["wall_seconds"], "chaos": observed["wall_seconds"]},
        "rollouts_written": observed["rollouts_written"],
        "receivers": args.receivers,
        "hung_ranks": observed["hung_ranks"],
        "interrupted_sends": observed.get("interrupted_sends", {}),
        "command": (
            f"rlship chaos --steps {args.steps} --kill-every {args.kill_every:g} "
            f"--receivers {args.receivers} --ship-kills {args.ship_kills} --json {args.json}"
        ),
    }
    report["goal_met"] = (
        all(n == args.steps for n in delivered.values())
        and not report["hung_ranks"]
        and duplicates == out_of_order == mismatches == 0
        and report["records_published"] == args.steps
        and report["records_duplicated"] == 0
        and report["keys_left"] == 0
        and report["kills"] >= 10
        and {"orchestrator", "ship-worker"} <= set(report["kills_by_target"])
        and report["kills_by_target"]["ship-worker"] >= args.ship_kills
    )
    return report


def print_report(report: dict[str, Any], path: Path) -> None:
    print(
        f"\nrlship chaos: {report['kills']} kills {report['kills_by_target']} "
        f"(stages {report['kills_by_stage']})\n"
        f"  steps delivered per rank {report['steps_delivered_per_rank']} of {report['steps_expected']}; "
        f"duplicates {report['duplicates_delivered']} ({report['duplicates_in_window']} of them sends "
        f"redone in the window between leaving and the mark), out of order {report['out_of_order']}, "
        f"payload mismatches {report['payload_mismatches']}; receivers {report['receivers']}, "
        f"hung ranks {report['hung_ranks']}, sends redone after an interrupted one "
        f"{sum(report['interrupted_sends'].values())}\n"
        f"  records {report['records_published']} (duplicated {report['records_duplicated']}), "
        f"keys left {report['keys_left']}; "
        f"wall {report['wall_seconds']['fault_free']:.1f} s fault-free, "
        f"{report['wall_seconds']['chaos']:.1f} s chaos\n"
        f"  goal {'MET' if report['goal_met'] else 'MISSED'}; details in {path}"
    )
