"""`rlship bench loop`: the orchestrator's event loop while it ships, in three placements.

The same seeded synthetic steps are shipped by the same stage functions to real trainer
rank processes over ZMQ, with every stage on the event loop (`inline`), in threads
(`thread`, the seed's design) and in Celery worker processes through Redis (`celery`,
rlship). Each placement runs in a fresh process (`orchestrator.commands.bench.placements`) with
its own run id, ZMQ ports and trainer ranks, so peaks and timelines never mix.

Per placement: loop lag (10 ms probe) and heartbeat delay (50 ms) over the ship windows
(cut to published record) of the measured steps, ship seconds per step, the orchestrator
process's peak RSS, tokens shipped, and whether every rank received byte-identical
payloads (by checksum, against a reference computed here with a plain call of the
stages). The first `--warmup-steps` steps bind sockets and warm the workers; they are
shipped and checked but not measured. A PNG of lag over time is written beside the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import redis

from orchestrator.commands.bench.cpu import SHIP_KINDS, CpuSampler, machine_cpu_seconds
from orchestrator.commands.bench.placements import (
    PLACEMENTS,
    StepBatch,
    cut_manifest,
    encode_step,
    step_batches,
)
from orchestrator.commands.bench.plot import plot_lag
from orchestrator.commands.processes import (
    ProcessGroup,
    delete_run_keys,
    redis_answers,
    rlship_command,
    wait_for_workers,
    worker_commands,
)
from orchestrator.commands.run import received_by_rank
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings, settings_to_env
from transport.checksum import payload_checksum
from transport.keys import RunKeys
from transport.zmq_sockets import free_port_pair

TRAINER_IDLE_SECONDS = 300
TRAINER_DRAIN_SECONDS = 120.0


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
        "--placements", default=",".join(PLACEMENTS), help="comma-separated, run in this order"
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
    if "celery" not in placements:
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
        "goals": goals(results),
        "wall_seconds": time.time() - started,
    }
    args.json.write_text(json.dumps(report, indent=1))
    png = args.json.with_suffix(".png")
    plotted = plot_lag(report, png)
    print_report(report)
    print(f"bench loop: wrote {args.json}" + (f" and {png}" if plotted else " (no PNG: matplotlib missing)"))
    return 0 if report["steps_identical"] else 1


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of every process it started and waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def other_cpu_share(before: tuple[float, float], wall: float) -> float:
    """The share of the machine's CPU that others (and Redis) used while the bench ran: the
    figures are only as quiet as the machine was."""
    others = (machine_cpu_seconds() - before[0]) - (own_cpu_seconds() - before[1])
    return max(0.0, others) / (wall * (os.cpu_count() or 1))


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run, every option spelled out."""
    options = " ".join(
        f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
        for name, value in vars(args).items()
        if value is not False
    )
    return f"rlship bench loop {options}"


# -- the workload and its reference payloads ------------------------------------------------


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


# -- one placement: trainers, workers, the orchestrator process, the producer ----------------


def _prioritized(
    command: list[str], niceness: int, idle_class: bool = False, fifo: bool = False
) -> list[str]:
    """`command` at this CPU priority (chrt and nice exec it: the PID stays the command's).
    SCHED_IDLE runs only when nothing else wants the CPU; SCHED_FIFO preempts every normal
    process as soon as it wakes."""
    policy = ["chrt", "--idle", "0"] if idle_class else ["chrt", "--fifo", "10"] if fifo else []
    return [*policy, *(["nice", "-n", str(niceness)] if niceness else []), *command]


def run_placement(
    placement: str, base: RunSettings, batches: list[StepBatch], args: argparse.Namespace, log_root: Path
) -> dict[str, Any]:
    """Ship every step in `placement`; return its process's result, what each rank received and
    the published records."""
    token = secrets.token_hex(3)
    log_dir = (log_root / placement).resolve()
    settings = base.model_copy(
        update={
            "run_id": f"bench-loop-{placement}-{token}",
            "zmq_port": free_port_pair(),
            "cpu_queue": f"bench-cpu-{token}",
            "ship_queue": f"bench-ship-{token}",
            "output_dir": log_dir,
        }
    )
    group = ProcessGroup(env=settings_to_env(settings), log_dir=log_dir)
    spec, result = log_dir / "spec.json", log_dir / "result.json"
    deadline = time.monotonic() + args.timeout
    client = redis.Redis.from_url(settings.redis_url)
    try:
        for rank in range(settings.ranks):
            trainer = rlship_command(
                "trainer", "--rank", str(rank), "--idle-timeout", str(TRAINER_IDLE_SECONDS)
            )
            group.start(f"trainer-{rank}", _prioritized(trainer, args.trainer_nice, args.idle_class))
        if placement == "celery":
            for name, command in worker_commands(settings).items():
                group.start(name, _prioritized(command, args.worker_nice, args.idle_class))
            wait_for_workers(settings, group)
        spec.write_text(
            json.dumps(
                {
                    "placement": placement,
                    "settings": settings.model_dump(mode="json"),
                    "timeout": args.timeout,
                }
            )
        )
        result.unlink(missing_ok=True)
        child = group.start(
            "orchestrator",
            _prioritized(
                [sys.executable, "-m", "orchestrator.commands.bench.placements", str(spec), str(result)],
                args.orchestrator_nice,
                fifo=args.orchestrator_fifo,
            ),
        )
        sampler = CpuSampler(process_kinds(group, client))
        sampler.start()
        if placement == "celery":
            feed(settings, batches, group, deadline)
        try:
            child.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR1)  # its threads' stacks, into its log
            time.sleep(1.0)
            raise RuntimeError(f"{placement}: not done within {args.timeout:.0f} s; see {log_dir}") from None
        finally:
            sampler.stop()
        if child.returncode != 0 or not result.exists():
            raise RuntimeError(
                f"{placement}: the orchestrator process exited with {child.returncode}; see {log_dir}"
            )
        drained = time.monotonic() + TRAINER_DRAIN_SECONDS
        for rank in range(settings.ranks):  # a rank that missed a step shows in `received`
            with contextlib.suppress(subprocess.TimeoutExpired):
                group.processes[f"trainer-{rank}"].wait(max(0.1, drained - time.monotonic()))
        received = received_by_rank(client, settings.run_id, settings.ranks)
        stream = client.xrange(RunKeys(settings.run_id).metrics_stream)
        records = [json.loads(fields[b"record"]) for _, fields in stream]
    finally:
        group.stop_all()
        delete_run_keys(settings)
    raw = json.loads(result.read_text())
    origin = raw["origin"]
    windows = {step: (start + origin, end + origin) for step, (start, end) in raw["windows"].items()}
    cpu = dict(zip(windows, sampler.in_windows(list(windows.values())), strict=True))
    return {**raw, "received": received, "records": records, "cpu": cpu}


def process_kinds(group: ProcessGroup, client: redis.Redis) -> dict[str, list[int]]:
    """The PIDs whose process trees make each kind's CPU: the Celery workers (their pool
    children are in their trees), the orchestrator process, the trainer ranks and, when it
    runs on this machine, the Redis server."""
    kinds: dict[str, list[int]] = {"orchestrator": [], "workers": [], "trainers": [], "redis": []}
    for name, process in group.processes.items():
        kind = "trainers" if name.startswith("trainer-") else "workers" if name.endswith("-worker") else name
        kinds.setdefault(kind, []).append(process.pid)
    redis_pid = int(client.info("server")["process_id"])
    with contextlib.suppress(psutil.Error):
        if "redis" in psutil.Process(redis_pid).name():
            kinds["redis"].append(redis_pid)
    return kinds


def feed(settings: RunSettings, batches: list[StepBatch], group: ProcessGroup, deadline: float) -> None:
    """The producer of the celery placement: step k's rollouts go to Redis once step k - 1 is
    published, so they are ingested before the cut, as the in-process placements hold theirs."""
    client = redis.Redis.from_url(settings.redis_url)
    producer = RolloutProducer.for_run(client, settings, admitted=False)  # a step's batch in one call
    published = RunKeys(settings.run_id).published
    for batch in batches:
        while batch.step and not client.hexists(published, batch.step - 1):
            if group.failed() or time.monotonic() > deadline:
                return
            time.sleep(0.01)
        producer.produce(batch.rollouts)


# -- figures ---------------------------------------------------------------------------------


def in_windows(timeline: dict[str, list[float]], windows: list[tuple[float, float]]) -> np.ndarray:
    """The observations whose sleeper was due inside a window (a stall that began before the
    window is not the window's, one that began inside it is, wherever it ends)."""
    t = np.asarray(timeline["t"], dtype=np.float64)
    ms = np.asarray(timeline["ms"], dtype=np.float64)
    due = t - ms / 1000.0
    keep = np.zeros(len(t), dtype=bool)
    for start, end in windows:
        keep |= (due >= start) & (due <= end)
    return ms[keep]


def summarize(raw: dict[str, Any], reference: list[list[str]], warmup: int) -> dict[str, Any]:
    """One placement's figures over its measured steps, and its checks over every step."""
    windows = {int(step): tuple(w) for step, w in raw["windows"].items()}
    measured = [windows[s] for s in sorted(windows) if s >= warmup]
    lag = in_windows(raw["lag"], measured)
    beat = in_windows(raw["heartbeat"], measured)
    p50, p95, p99 = np.percentile(lag, [50, 95, 99]) if len(lag) else (np.nan,) * 3
    identical = all(
        raw["received"].get(str(rank), {}).get("checksums") == [step[rank] for step in reference]
        for rank in range(len(reference[0]))
    )
    origin = min(start for start, _ in windows.values()) if windows else 0.0
    records = sorted(raw["records"], key=lambda r: r["step"])
    cpu = [raw["cpu"][str(s)] for s in sorted(windows) if s >= warmup]
    return {
        "lag_ms": {
            "p50": float(p50),
            "p95": float(p95),
            "p99": float(p99),
            "max": float(lag.max()) if len(lag) else float("nan"),
        },
        "heartbeat_p95_ms": float(np.percentile(beat, 95)) if len(beat) else float("nan"),
        "heartbeat_max_ms": float(beat.max()) if len(beat) else float("nan"),
        "ship_seconds": [end - start for start, end in measured],
        "orchestrator_peak_rss_bytes": raw["peak_rss_bytes"],
        "orchestrator_baseline_rss_bytes": raw["baseline_rss_bytes"],
        "orchestrator_rss_growth_bytes": raw["peak_rss_bytes"] - raw["baseline_rss_bytes"],
        "cpu_seconds": cpu,
        "cpu_seconds_per_step": median_step(cpu),
        "tokens_shipped": int(sum(r.get("progress/tokens", 0.0) for r in records)),
        "steps_identical": identical,
        "lag_observations": len(lag),
        "heartbeat_observations": len(beat),
        "stage_seconds": [
            {
                k.split("/", 1)[1]: v
                for k, v in r.items()
                if k.startswith("time/") and k not in ("time/wait_for_policy", "time/wait_for_ckpt")
            }
            for r in records
            if r["step"] >= warmup
        ],
        "windows": [
            {"step": s, "start": windows[s][0] - origin, "end": windows[s][1] - origin, "warmup": s < warmup}
            for s in sorted(windows)
        ],
        "timeline": {
            name: {"t": [round(t - origin, 4) for t in raw[name]["t"]], "ms": raw[name]["ms"]}
            for name in ("lag", "heartbeat")
        },
    }


def median_step(cpu: list[dict[str, float]]) -> dict[str, float]:
    """The CPU by kind of the measured step whose ship CPU is the median (the lower middle
    of an even count): robust to a step that other programs slowed, and its kinds add up."""
    return sorted(cpu, key=lambda step: step["ship"])[(len(cpu) - 1) // 2]


def goals(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The goals of issue 16 that the placements run allows to check (the lag and RSS bounds
    are meant at four times the seed's scale, the CPU and ship ratios at the default size)."""
    out: list[dict[str, Any]] = []

    def goal(name: str, value: float, target: float, passed: bool) -> None:
        out.append({"goal": name, "value": value, "target": target, "pass": bool(passed)})

    celery, thread = results.get("celery"), results.get("thread")
    if celery is not None:
        goal("celery lag_ms.max <= 20", celery["lag_ms"]["max"], 20.0, celery["lag_ms"]["max"] <= 20.0)
        goal("celery lag_ms.p99 <= 5", celery["lag_ms"]["p99"], 5.0, celery["lag_ms"]["p99"] <= 5.0)
        growth = celery["orchestrator_rss_growth_bytes"] / 2**20
        goal("celery orchestrator RSS growth over imports <= 32 MiB", growth, 32.0, growth <= 32.0)
    if celery is not None and thread is not None:
        cpu = celery["cpu_seconds_per_step"]["ship"] / max(thread["cpu_seconds_per_step"]["ship"], 1e-9)
        goal("celery / thread CPU seconds per step (ship kinds) <= 1.3", cpu, 1.3, cpu <= 1.3)
        speed = statistics.median(celery["ship_seconds"]) / statistics.median(thread["ship_seconds"])
        goal("celery / thread median ship_seconds <= 1.5", speed, 1.5, speed <= 1.5)
    identical = all(r["steps_identical"] for r in results.values())
    goal("steps_identical", float(identical), 1.0, identical)
    return out


def summary_line(placement: str, result: dict[str, Any]) -> str:
    lag = result["lag_ms"]
    return (
        f"{placement}: lag p50 {lag['p50']:.2f} p99 {lag['p99']:.2f} max {lag['max']:.1f} ms | "
        f"heartbeat p95 {result['heartbeat_p95_ms']:.1f} max {result['heartbeat_max_ms']:.1f} ms | "
        f"ship {statistics.median(result['ship_seconds']):.2f} s (median) | "
        f"peak RSS {result['orchestrator_peak_rss_bytes'] / 2**20:.0f} MiB "
        f"(+{result['orchestrator_rss_growth_bytes'] / 2**20:.0f} over imports) | "
        f"CPU {1000 * result['cpu_seconds_per_step']['ship']:.0f} ms a step | "
        f"identical {result['steps_identical']}"
    )


def print_report(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(
        f"\nworkload per step: {w['rollouts'][-1]} rollouts, {w['tokens'][-1]:,} tokens, "
        f"{w['wire_bytes'][-1] / 2**20:.1f} MiB on the wire (last step)"
    )
    for placement, result in report["placements"].items():
        print("  " + summary_line(placement, result))
    print_cpu_table(report["placements"])
    for goal in report["goals"]:
        print(f"  {'PASS' if goal['pass'] else 'MISS'}  {goal['goal']}: {goal['value']:.3g}")
    print(f"  other processes used {report['machine']['other_cpu_share']:.0%} of the CPU meanwhile")


def print_cpu_table(placements: dict[str, dict[str, Any]]) -> None:
    """CPU milliseconds per measured step (`median_step`) by process kind; `ship` sums the
    orchestrator, the workers and Redis; trainer ranks and other programs apart."""
    columns = [*SHIP_KINDS, "ship", "trainers", "others"]
    print("\n  CPU ms per step (the step of median ship CPU): " + " | ".join(columns))
    for placement, result in placements.items():
        cpu = result["cpu_seconds_per_step"]
        print(f"  {placement:>9}: " + " | ".join(f"{1000 * cpu.get(c, 0.0):7.0f}" for c in columns))
