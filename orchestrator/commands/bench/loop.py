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
stages). `--placements celery,celery-traced` runs the celery placement beside itself with
tracing on (every process exporting to a local OTLP receiver that discards) and reports the
ratio of CPU per step's cycle, a cut to the next: all one step costs every process (issue 37's
goal: at most 1.03); `celery,celery-curve` the same with `--zmq-curve` (issue 38's goal: at
most 1.1). A placement named again (`celery,celery-traced,celery,celery-traced`) runs again
after the others and pools its cycles with its earlier rounds': alternating rounds cancel
the machine's drift between them. The first `--warmup-steps` steps
bind sockets and warm the workers; they are shipped and checked but not measured. A PNG
of lag over time is written beside the JSON.

`--inference-concurrency C` adds the orchestrator's own inference traffic, as prime-rl's loop
drives it: in each placement's process, C streaming requests in flight to a mock inference
server (`mock_inference`, a process of its own started for the placement), first alone (the
baseline), then while the placement ships; each placement then reports `inference`
(`inference_figures`): what shipping kept of the load's throughput, its latency and time to
first token against the baseline's, beside the windows' lag and the trainer's idle time.

`--workload moe` compares variants instead (`orchestrator.commands.bench.moe.VARIANTS`): the
same rollouts, each with routed experts of a 48-layer top-8 model (384 bytes a token), shipped
by the celery placement without them (dense), by handle (rows files under the payload root,
wire prime-rl-0f59b24) and inline (through Redis, or through the run's directory with
`payload_store` dir), and by the thread placement with them in its memory, encoded inline.
Each variant also reports Redis's peak used memory (on a Redis server of its own, so the peak
is the run's) and the peak bytes under its payload directories, and the report prints the
ratios of the issue's goals against the dense run. The bench makes each step once and keeps
it in files beside the JSON (`StepCache`, removed at the end): no process holds more than the
step it ships.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from orchestrator.commands.bench.cpu import machine_cpu_seconds, other_cpu_share, own_cpu_seconds
from orchestrator.commands.bench.harness import StepSource, placement_settings, run_placement
from orchestrator.commands.bench.memory import MemoryLimitReached
from orchestrator.commands.bench.moe import (
    DEFAULT_VARIANTS,
    VARIANTS,
    StepCache,
    Variant,
    handle_segments,
    without_experts,
)
from orchestrator.commands.bench.placements import (
    DEFAULT_PLACEMENTS,
    PLACEMENTS,
    StepBatch,
    cut_manifest,
    pack_step,
    rank_checksums,
    step_batches,
)
from orchestrator.commands.bench.plot import plot_lag
from orchestrator.commands.bench.printout import print_report, summary_line
from orchestrator.commands.bench.summary import (
    curve_cost,
    durability_cost,
    goals,
    moe_goals,
    moe_ratios,
    pool_rounds,
    summarize,
    tracing_cost,
)
from orchestrator.commands.processes import redis_answers
from orchestrator.settings import RunSettings
from tasks.stages.release import trim_process_memory
from transport.payload_segments import PAYLOAD_FIELD
from transport.schema import WIRE_PROFILES


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
        "--workload",
        choices=("dense", "moe"),
        default="dense",
        help="dense: the placements on dense rollouts; moe: the same rollouts with routed experts "
        "(48 layers x top-8, uint8) in the variants of --placements, with Redis's peak memory, "
        "payload directory bytes and the goals' ratios against celery-dense",
    )
    parser.add_argument(
        "--placements",
        default=None,
        help=f"comma-separated, run in this order, of {', '.join(PLACEMENTS)} (default "
        f"{','.join(DEFAULT_PLACEMENTS)}); with --workload moe of {', '.join(VARIANTS)} "
        f"(default {','.join(DEFAULT_VARIANTS)})",
    )
    parser.add_argument(
        "--redis-server",
        choices=("shared", "own"),
        default=None,
        help="the Redis of REDIS_URL, or a redis-server started for each placement (its peak memory "
        "is then the run's own); default own with --workload moe, else shared",
    )
    parser.add_argument(
        "--min-available-mib",
        type=int,
        default=None,
        help="with --workload moe, a placement is stopped (and reported as such) when the machine's "
        "available memory falls below this (default 2048; 0: never); the bench goes on with the next",
    )
    parser.add_argument(
        "--payload-root",
        type=Path,
        default=None,
        help="where rows files of routed experts by handle are written (default: beside the JSON)",
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
    inference = parser.add_argument_group(
        "the orchestrator's own inference traffic (orchestrator.commands.bench.inference)"
    )
    inference.add_argument(
        "--inference-concurrency",
        type=int,
        default=None,
        help="requests the orchestrator's loop keeps in flight to a mock inference server while it "
        "ships (64 to 1024, as prime-rl's orchestrator); each placement reports `inference`",
    )
    inference.add_argument(
        "--inference-ttft-ms", type=float, default=100.0, help="the server's time to first token"
    )
    inference.add_argument(
        "--inference-token-ms", type=float, default=10.0, help="the server's time per token"
    )
    inference.add_argument("--inference-chunk-tokens", type=int, default=16, help="tokens per streamed chunk")
    inference.add_argument(
        "--inference-warmup-seconds",
        type=float,
        default=30.0,
        help="the load alone before its baseline; longer than nearly every request (the default "
        "pace's p99 is about 25 s): a request longer than warmup + baseline cannot complete in the "
        "baseline, which would cut its latency p99 short and count the first short answers' burst",
    )
    inference.add_argument(
        "--inference-baseline-seconds",
        type=float,
        default=10.0,
        help="the load alone, measured: the figures without shipping, in the same process before it ships",
    )


@dataclass(frozen=True)
class Run:
    """One placement's run: its name in the report, its variant, its run settings."""

    name: str
    variant: Variant
    settings: RunSettings

    @property
    def reference_kind(self) -> tuple[Any, ...]:
        """What makes its payloads the bytes they are: how routed experts travel, the wire,
        and for handles the run's rows directory (the segments name their files)."""
        handle = self.variant.routed_experts == "handle"
        return self.variant.routed_experts, self.settings.wire, self.settings.run_rows() if handle else None


def variants_of(args: argparse.Namespace) -> list[tuple[str, Variant]]:
    """The placements to run, in order (one named twice runs twice; the report keeps the
    later): under `--workload moe` entries of `VARIANTS`, else each placement on dense
    rollouts."""
    moe = args.workload == "moe"
    known = VARIANTS if moe else {name: Variant(name) for name in PLACEMENTS}
    default = DEFAULT_VARIANTS if moe else DEFAULT_PLACEMENTS
    names = [p.strip() for p in (args.placements or ",".join(default)).split(",") if p.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise SystemExit(f"rlship: --placements: {unknown or names} not among {', '.join(known)}")
    return [(name, known[name]) for name in names]


def main(args: argparse.Namespace) -> int:
    variants = variants_of(args)
    args.placements = ",".join(name for name, _ in variants)  # as run, for the report's command line
    if args.workload == "moe":
        args.redis_server = args.redis_server or "own"
        args.min_available_mib = 2048 if args.min_available_mib is None else args.min_available_mib
    if args.steps < 1 or args.warmup_steps < 0:
        raise SystemExit("rlship: --steps must be >= 1 and --warmup-steps >= 0")
    check_inference_options(args)
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
    if args.redis_server != "own" and not redis_answers(base.redis_url):
        raise SystemExit(f"rlship: no Redis answers at REDIS_URL={base.redis_url!r}")
    out_dir = args.json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    payload_root = args.payload_root or out_dir / "payloads"
    runs = [
        Run(name, variant, placement_settings(name, variant, base, out_dir / "logs", payload_root))
        for name, variant in variants
    ]
    started = time.time()
    load_before = os.getloadavg()
    cpu_before = machine_cpu_seconds(), own_cpu_seconds()

    print(f"bench loop: generating {base.steps} steps of {args.rollouts} rollouts and the reference payloads")
    cache = StepCache(out_dir / "steps") if args.workload == "moe" else None
    try:
        if cache is None:
            batches = list(step_batches(base, base.steps))
            workload, references = reference_payloads(base, batches, runs)
            if not any(run.variant.placement.startswith("celery") for run in runs):
                batches.clear()
            sources = [StepSource.of_list(batches)] * len(runs)
        else:
            made = step_batches(base, base.steps, moe=True)
            workload, references = reference_payloads(base, made, runs, cache)
            sources = [
                StepSource.of_cache(cache, base.steps, run.variant.routed_experts != "none") for run in runs
            ]
        results: dict[str, dict[str, Any]] = {}
        stopped: dict[str, str] = {}
        for run, reference, source in zip(runs, references, sources, strict=True):
            print(f"bench loop: {run.name} ...", flush=True)
            try:
                raw = run_placement(run.variant, run.settings, source, args)
            except MemoryLimitReached as exc:
                stopped[run.name] = str(exc)
                print(f"  {exc}", flush=True)
                continue
            summary = summarize(raw, reference, args.warmup_steps)
            earlier = results.get(run.name)
            results[run.name] = summary if earlier is None else pool_rounds(earlier, summary)
            if args.workload == "moe":
                results[run.name]["variant"] = {**run.variant.describe(), "wire": run.settings.wire}
            print("  " + summary_line(run.name, results[run.name]), flush=True)
    finally:
        if cache is not None:
            cache.remove()
        with contextlib.suppress(OSError):
            payload_root.rmdir()  # when no run left anything in it

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
        "goals": moe_goals(results) if args.workload == "moe" else goals(results, args.rollouts),
        **({"ratios": moe_ratios(results), "stopped_for_memory": stopped} if args.workload == "moe" else {}),
        "durability_cost": durability_cost(results),
        "tracing_cost": tracing_cost(results),
        "curve_cost": curve_cost(results),
        "wall_seconds": time.time() - started,
    }
    args.json.write_text(json.dumps(report, indent=1))
    png = args.json.with_suffix(".png")
    plotted = plot_lag(report, png) if results else False
    print_report(report)
    print(f"bench loop: wrote {args.json}" + (f" and {png}" if plotted else " (no PNG)"))
    return 0 if report["steps_identical"] and not report.get("stopped_for_memory") else 1


def check_inference_options(args: argparse.Namespace) -> None:
    """A bad inference option fails before anything starts, named with its value."""
    if args.inference_concurrency is None:
        return
    if args.inference_concurrency < 1:
        raise SystemExit(f"rlship: --inference-concurrency: must be >= 1 (got {args.inference_concurrency})")
    if args.inference_chunk_tokens < 1:
        raise SystemExit(
            f"rlship: --inference-chunk-tokens: must be >= 1 (got {args.inference_chunk_tokens})"
        )
    for name in ("ttft_ms", "token_ms", "warmup_seconds"):
        value = getattr(args, f"inference_{name}")
        if not value >= 0:
            raise SystemExit(f"rlship: --inference-{name.replace('_', '-')}: must be >= 0 (got {value})")
    if not args.inference_baseline_seconds > 0:
        raise SystemExit(
            f"rlship: --inference-baseline-seconds: must be > 0 (got {args.inference_baseline_seconds})"
        )


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run, every option spelled out (the inference load's
    only when it ran)."""
    without_load = args.inference_concurrency is None
    options = " ".join(
        f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
        for name, value in vars(args).items()
        if value is not False and value is not None and not (without_load and name.startswith("inference_"))
    )
    return f"rlship bench loop {options}"


def reference_payloads(
    base: RunSettings, batches: Iterable[StepBatch], runs: list[Run], cache: StepCache | None = None
) -> tuple[dict[str, Any], list[dict[str, list[list[Any]]]]]:
    """What every placement must ship, by the stage functions in a plain call: per step, the
    rollouts, tokens and wire bytes, and per run each rank's payload checksum and (side
    arrays by handle) the checksum of the rows it reads. Runs that ship the same bytes
    (`Run.reference_kind`) share one computation. With a `cache`, each step (made with
    routed experts) is kept in it, then let go."""
    kinds = [run.reference_kind for run in runs]
    workload: dict[str, Any] = {"rollouts": [], "tokens": [], "wire_bytes": []}
    computed: dict[tuple[Any, ...], dict[str, list[list[Any]]]] = {
        kind: {"checksums": [], "rows_checksums": [], "wire_bytes": []} for kind in kinds
    }
    routed = []
    for batch in batches:
        if cache is not None:
            routed.append(cache.write(batch))
        dense = {record.rollout_id: without_experts(arrays) for record, arrays in batch.rollouts}
        samples, plan = pack_step(cut_manifest(base, batch.step, batch.outcomes), dense)
        for kind, reference in computed.items():
            experts, wire, rows = kind
            arrays = dense if experts == "none" else batch.arrays
            if experts == "handle":
                segments = handle_segments(batch.rollouts, rows)
                arrays = {rid: a | {PAYLOAD_FIELD: segments[rid]} for rid, a in dense.items()}
            checksums, rows_checksums, wire_bytes = rank_checksums(samples, plan, arrays, WIRE_PROFILES[wire])
            reference["checksums"].append(checksums)
            reference["rows_checksums"].append(rows_checksums)
            reference["wire_bytes"].append(wire_bytes)
            del arrays
        workload["rollouts"].append(len(batch.rollouts))
        workload["tokens"].append(sum(len(arrays["input_ids"]) for arrays in dense.values()))
        del batch, dense
        trim_process_memory()
    workload["wire_bytes"] = computed[kinds[0]]["wire_bytes"]
    if cache is not None:
        workload["routed_experts_bytes"] = routed
        by_placement = {run.name: computed[run.reference_kind]["wire_bytes"] for run in runs}
        workload["wire_bytes_by_placement"] = by_placement
    return workload, [computed[kind] for kind in kinds]
