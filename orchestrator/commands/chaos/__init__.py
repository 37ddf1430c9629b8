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

Redis is REDIS_URL's (TLS included) and every process connects as its role's user when the
run's settings give one (`redis_{role}_auth`, as `rlship run`): the command, as REDIS_URL's
user, gives each run's users that run's rules (`rlship acl`'s) before the run and deletes
them after it.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import signal
import sys
from pathlib import Path

from orchestrator.acl import roles_with_users
from orchestrator.commands.chaos.kills import STOCK_STAGES, KillPlan
from orchestrator.commands.chaos.report import compare, print_report
from orchestrator.commands.chaos.system import RunFailed, run_system
from orchestrator.commands.processes import delete_run_keys
from orchestrator.commands.sentinel_cluster import LocalSentinelCluster
from orchestrator.settings import RunSettings
from tasks.graph import STAGE_NAMES
from transport.zmq_sockets import free_port_pair


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
    parser.add_argument(
        "--workload",
        choices=["dense", "moe", "moe-inline"],
        default="dense",
        help="the synthetic rollouts: dense, or with routed experts by handle (moe) or inline",
    )
    parser.add_argument(
        "--payload-store", choices=["redis", "dir"], default="redis", help="where payloads are retained"
    )
    parser.add_argument(
        "--kill-redis-primary",
        type=int,
        default=0,
        metavar="N",
        help="run both runs on a primary, a replica and three Sentinels of their own, and SIGKILL "
        "the chaos run's primary N times (each time started again as the new primary's replica)",
    )


def main(args: argparse.Namespace) -> int:
    token = secrets.token_hex(3)
    out_dir = args.json.parent
    cluster = None
    if args.kill_redis_primary > 0:
        cluster = LocalSentinelCluster((out_dir / f"redis-{token}").resolve()).start()
        print(f"rlship chaos: Redis is a primary, a replica and three Sentinels: {cluster.url}", flush=True)
    try:
        return _chaos(args, token, cluster)
    finally:
        if cluster is not None:
            cluster.stop()


def _chaos(args: argparse.Namespace, token: str, cluster: LocalSentinelCluster | None) -> int:
    base = RunSettings()  # REDIS_URL from the environment, as every rlship process reads it
    out_dir = args.json.parent
    common = {
        "redis_url": cluster.url if cluster is not None else base.redis_url,
        "steps": args.steps,
        "ranks": args.ranks,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "max_off_policy_steps": args.steps + 1,  # written up front, so never stale
        "stall_seconds": 5.0,
        "samples_per_step": 0,
        "trainers": "external" if args.receivers == "stock" else "builtin",
        "workload": args.workload,
        "payload_store": args.payload_store,
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
    roles = roles_with_users(reference)
    if roles:
        print(
            f"rlship chaos: the {', '.join(roles)} processes connect as their roles' users "
            "(redis_*_auth), given each run's rules and deleted after it",
            flush=True,
        )
    print(f"rlship chaos: fault-free run of {args.steps} steps ({reference.run_id})", flush=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that every child is stopped
    stages = STOCK_STAGES if args.receivers == "stock" else STAGE_NAMES
    plan = KillPlan(args.ship_kills, stages, args.kill_redis_primary, cluster)
    try:
        expected = run_system(reference, None, random.Random(args.seed), args.timeout, args.receivers, plan)
        print(f"rlship chaos: the same with a kill every {args.kill_every:g} s ({chaos.run_id})", flush=True)
        rng = random.Random(args.seed)
        observed = run_system(chaos, args.kill_every, rng, args.timeout, args.receivers, plan)
    except RunFailed as exc:
        print(f"rlship chaos: {exc}", file=sys.stderr)
        return 1
    finally:
        for settings in (reference, chaos):
            delete_run_keys(settings)
    report = compare(args, chaos.step_numbers, expected, observed)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print_report(report, args.json)
    return 0 if report["goal_met"] else 1


def _exit_on_sigterm(*_: object) -> None:
    print("rlship chaos: terminated", file=sys.stderr)
    raise SystemExit(128 + signal.SIGTERM)
