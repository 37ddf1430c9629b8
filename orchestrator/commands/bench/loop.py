"""`rlship bench loop`: the orchestrator's event loop while it ships, in three placements.

The same seeded synthetic steps are shipped by the same stage functions to real trainer
rank processes over ZMQ, with every stage on the event loop (`inline`), in threads
(`thread`, the seed's design) and in Celery worker processes through Redis (`celery`,
rlship). Each placement runs in a fresh process (`orchestrator.commands.bench.placements`) with
its own run id, ZMQ ports and trainer ranks, so peaks and timelines never mix; `harness`
starts and watches those processes, `summary` makes the figures, goals and report.

Per placement: loop lag (10 ms probe) and heartbeat delay (50 ms) over the ship windows
(cut to published record) of the measured steps, ship seconds per step, the trainer's idle
time per step (its last rollout arriving to its last rank having decoded it), the orchestrator
process's peak RSS, tokens shipped, and whether every rank received byte-identical
payloads (by checksum, against a reference computed here with a plain call of the
stages). The first `--warmup-steps` steps bind sockets and warm the workers; they are
shipped and checked but not measured. A PNG of lag over time is written beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import psutil

from orchestrator.commands.bench.cpu import machine_cpu_seconds, other_cpu_share, own_cpu_seconds
from orchestrator.commands.bench.harness import run_placement
from orchestrator.commands.bench.placements import (
    DEFAULT_PLACEMENTS,
    PLACEMENTS,
    StepBatch,
    cut_manifest,
    encode_step,
    step_batches,
)
from orchestrator.commands.bench.plot import plot_lag
from orchestrator.commands.bench.summary import durability_cost, goals, print_report, summarize, summary_line
from orchestrator.commands.processes import redis_answers
from orchestrator.settings import RunSettings
from transport.checksum import payload_checksum


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", type=Path, default=Path("runs/bench-loop/loop.json"), help="results (PNG beside)"
    )
    parser.add_argument("--rollouts", type=int, default=1024, help="rollouts per step (whole groups)")
    parser.add_argument("--seq-len", type=int, default=8192, help="longest rollout and micro-batch, tokens")
    parser.add_argument("--ranks", type=int, default=8, help="trainer rank processes (ZMQ)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per placement")
    parser.add_argument("--warmup-steps", type=int, default=1, help="shipped and checked, not measured")
    parser.add_argument(
        "--placements",
        default=",".join(DEFAULT_PLACEMENTS),
        help=f"comma-separated, run in this order, of {', '.join(PLACEMENTS)}",
    )
    parser.add_argument(
        "--fill-seconds",
        type=float,
        default=None,
        help="seconds over which a step's rollouts arrive (celery); default 0.5 ms a rollout",
    )
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-workers", type=int, default=2, help="processes of the Celery cpu worker")
    parser.add_argument("--worker-nice", type=int, default=10, help="niceness of the Celery workers")
    parser.add_argument("--trainer-nice", type=int, default=10, help="niceness of the trainer ranks")
    parser.add_argument(
        "--orchestrator-nice", type=int, default=0, help="niceness of the orchestrator (< 0 needs root)"
    )
    parser.add_argument(
        "--orchestrator-fifo",
        action="store_true",
        help="the orchestrator in SCHED_FIFO (real-time, priority 10; needs root or CAP_SYS_NICE)",
    )
    parser.add_argument(
        "--idle-class",
        action="store_true",
        help="workers and trainers in SCHED_IDLE: CPU only when the orchestrator does not want it",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per placement")


def main(args: argparse.Namespace) -> int:
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    unknown = sorted(set(placements) - set(PLACEMENTS))
    if unknown or not placements:
        raise SystemExit(f"rlship: --placements: {unknown or placements} not among {', '.join(PLACEMENTS)}")
    if args.steps < 1 or args.warmup_steps < 0:
        raise SystemExit("rlship: --steps must be >= 1 and --warmup-steps >= 0")
    base = RunSettings(
        run_id="bench-loop",
        steps=args.warmup_steps + args.steps,
        ranks=args.ranks,
        batch_size=args.rollouts,
        group_size=args.group_size,
        seq_len=args.seq_len,
        seed=args.seed,
        max_async_level=0,
        cpu_workers=args.cpu_workers,
    )
    if not redis_answers(base.redis_url):
        raise SystemExit(f"rlship: no Redis answers at REDIS_URL={base.redis_url!r}")
    out_dir = args.json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load_before = os.getloadavg()
    cpu_before = machine_cpu_seconds(), own_cpu_seconds()

    print(f"bench loop: generating {base.steps} steps of {args.rollouts} rollouts and the reference payloads")
    batches = list(step_batches(base, base.steps))
    workload, reference = reference_payloads(base, batches)
    if not any(placement.startswith("celery") for placement in placements):
        batches.clear()

    results: dict[str, dict[str, Any]] = {}
    for placement in placements:
        print(f"bench loop: {placement} ...", flush=True)
        raw = run_placement(placement, base, batches, args, out_dir / "logs")
        results[placement] = summarize(raw, reference, args.warmup_steps)
        print("  " + summary_line(placement, results[placement]), flush=True)

    report: dict[str, Any] = {
        "command": command_line(args),
        "machine": {
            "cpus": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "other_cpu_share": other_cpu_share(cpu_before, time.time() - started),
        },
        "settings": {
            **{name: value for name, value in vars(args).items() if name != "json"},
            "max_async_level": base.max_async_level,
        },
        "workload": workload,
        "placements": results,
        "steps_identical": all(r["steps_identical"] for r in results.values()),
        "goals": goals(results, args.rollouts),
        "durability_cost": durability_cost(results),
        "wall_seconds": time.time() - started,
    }
    args.json.write_text(json.dumps(report, indent=1))
    png = args.json.with_suffix(".png")
    plotted = plot_lag(report, png)
    print_report(report)
    print(f"bench loop: wrote {args.json}" + (f" and {png}" if plotted else " (no PNG: matplotlib missing)"))
    return 0 if report["steps_identical"] else 1


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run, every option spelled out."""
    options = " ".join(
        f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
        for name, value in vars(args).items()
        if value is not False and value is not None
    )
    return f"rlship bench loop {options}"


def reference_payloads(
    settings: RunSettings, batches: list[StepBatch]
) -> tuple[dict[str, list[int]], list[list[str]]]:
    """What every placement must ship: per step, the rollouts, tokens and wire bytes, and
    each rank's payload checksum."""
    workload: dict[str, list[int]] = {"rollouts": [], "tokens": [], "wire_bytes": []}
    checksums = []
    for batch in batches:
        payloads = encode_step(cut_manifest(settings, batch.step, batch.outcomes), batch.arrays)
        workload["rollouts"].append(len(batch.rollouts))
        workload["tokens"].append(sum(len(arrays["input_ids"]) for _, arrays in batch.rollouts))
        workload["wire_bytes"].append(sum(len(p) for p in payloads))
        checksums.append([payload_checksum(p) for p in payloads])
    return workload, checksums
