"""The figures of `rlship bench loop`: each placement's lag, heartbeat, ship time, memory
and CPU over its measured steps, the goals they meet, and the printed report (under
`--workload moe` also Redis's peak memory, the payload directories' peak bytes and the
ratios the issue's goals are about, against the celery placement on dense rollouts)."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from orchestrator.commands.bench.cpu import SHIP_KINDS
from orchestrator.commands.bench.inference_figures import inference_figures, print_inference_table
from tasks.stages.record_names import shipped_tokens


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


def identical_steps(received: dict[str, Any], reference: dict[str, list[list[Any]]]) -> bool:
    """Whether every rank received the reference's payload at every step and, where its
    payloads point at side arrays by handle, read the reference's rows."""
    checksums, rows = reference["checksums"], reference["rows_checksums"]
    for rank in range(len(checksums[0])):
        got = received.get(str(rank), {})
        if got.get("checksums") != [step[rank] for step in checksums]:
            return False
        expected_rows = {str(step): ranks[rank] for step, ranks in enumerate(rows) if ranks[rank] is not None}
        if got.get("rows_checksums", {}) != expected_rows:
            return False
    return True


def summarize(raw: dict[str, Any], reference: dict[str, list[list[Any]]], warmup: int) -> dict[str, Any]:
    """One placement's figures over its measured steps, and its checks over every step."""
    windows = {int(step): tuple(w) for step, w in raw["windows"].items()}
    measured = [windows[s] for s in sorted(windows) if s >= warmup]
    lag = in_windows(raw["lag"], measured)
    beat = in_windows(raw["heartbeat"], measured)
    p50, p95, p99 = np.percentile(lag, [50, 95, 99]) if len(lag) else (np.nan,) * 3
    identical = identical_steps(raw["received"], reference)
    origin = min(start for start, _ in windows.values()) if windows else 0.0
    records = sorted(raw["records"], key=lambda r: r["step"])
    cpu = [raw["cpu"][str(s)] for s in sorted(windows) if s >= warmup]
    cycles = [
        raw["cpu_cycles"][str(s)] for s in sorted(windows) if s >= warmup and str(s) in raw["cpu_cycles"]
    ]
    idle = {int(step): seconds for step, seconds in raw["idle_seconds"].items()}
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
        # From the step's last rollout arriving to its last rank having decoded it: what the
        # waiting trainer feels (issue 26).
        "idle_seconds": [idle[s] for s in sorted(idle) if s >= warmup],
        "orchestrator_peak_rss_bytes": raw["peak_rss_bytes"],
        "orchestrator_baseline_rss_bytes": raw["baseline_rss_bytes"],
        "orchestrator_rss_growth_bytes": raw["peak_rss_bytes"] - raw["baseline_rss_bytes"],
        "cpu_seconds": cpu,
        "cpu_seconds_per_step": median_step(cpu),
        "cpu_cycles": cycles,
        "cpu_seconds_per_cycle": mean_step(cycles),
        "rounds": 1,
        "tokens_shipped": int(sum(map(shipped_tokens, records))),
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
        **memory_figures(raw, raw["origin"] + origin),
        **({"inference": with_ship_figures(raw, measured, lag, idle, warmup)} if "inference" in raw else {}),
        **({"otlp_received": raw["otlp_received"]} if "otlp_received" in raw else {}),
    }


def with_ship_figures(
    raw: dict[str, Any],
    measured: list[tuple[float, float]],
    lag: np.ndarray,
    idle: dict[int, float],
    warmup: int,
) -> dict[str, Any]:
    """The inference load's figures, with the loop's lag and the trainer's idle time of the
    same windows beside them (the load ran through them), and the heartbeat's delay in the
    baseline: what the load alone does to the loop."""
    load = raw["inference"]
    alone = in_windows(raw["heartbeat"], [tuple(load["baseline"])]) if load["baseline"] else np.zeros(0)
    return {
        **inference_figures(load, measured),
        "lag_ms": _p99_max(lag),
        "baseline_heartbeat_ms": _p99_max(alone),
        "trainer_idle_seconds": [idle[s] for s in sorted(idle) if s >= warmup],
    }


def _p99_max(ms: np.ndarray) -> dict[str, float]:
    if not len(ms):
        return {"p99": float("nan"), "max": float("nan")}
    return {"p99": float(np.percentile(ms, 99)), "max": float(ms.max())}


def memory_figures(raw: dict[str, Any], origin: float) -> dict[str, Any]:
    """Redis's peak used memory and the payload directories' peak bytes (`--workload moe`),
    with the details they come from; their timelines in seconds since `origin` (monotonic:
    the placement's first cut)."""
    if "redis_memory" not in raw:
        return {}
    redis, directories = dict(raw["redis_memory"]), dict(raw["directories"])
    for figures in (redis, directories):
        timeline = figures.pop("timeline")
        figures["timeline"] = {"t": [round(t - origin, 3) for t in timeline["t"]], "mib": timeline["mib"]}
    return {
        "redis_peak_used_memory_bytes": redis["peak_bytes"],
        "redis_peak_growth_bytes": redis["peak_growth_bytes"],
        "payload_root_peak_bytes": directories["peak_bytes"]["payload_root"],
        **(
            {"payload_dir_peak_bytes": directories["peak_bytes"]["payload_dir"]}
            if "payload_dir" in directories["peak_bytes"]
            else {}
        ),
        "payload_directories_peak_bytes": directories["peak_total_bytes"],
        "redis_memory": redis,
        "directories": directories,
    }


def median_step(cpu: list[dict[str, float]]) -> dict[str, float]:
    """The CPU by kind of the measured step whose ship CPU is the median (the lower middle
    of an even count): robust to a step that other programs slowed, and its kinds add up."""
    return sorted(cpu, key=lambda step: step["ship"])[(len(cpu) - 1) // 2]


def mean_step(cpu: list[dict[str, float]]) -> dict[str, float]:
    """The mean CPU by kind over steps' cycles (a cut to the next): all a step costs, so the
    total over the run divided by its steps, not a robust middle (empty: no full cycle)."""
    return {kind: statistics.fmean(step[kind] for step in cpu) for kind in cpu[0]} if cpu else {}


def pool_rounds(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """A placement run again in the same bench (`--placements celery,celery-traced,celery,...`):
    the later round's figures, with the CPU per cycle over the cycles of every round."""
    cycles = earlier["cpu_cycles"] + later["cpu_cycles"]
    return {
        **later,
        "cpu_cycles": cycles,
        "cpu_seconds_per_cycle": mean_step(cycles),
        "rounds": earlier["rounds"] + 1,
    }


# Issue 26's bound on celery's idle time over the thread placement's: 1.0 at the default
# size (1,024 rollouts a step), 0.7 from the seed's (4,096) on.
def idle_target(rollouts: int) -> float:
    return 1.0 if rollouts <= 1024 else 0.7


def goals(results: dict[str, dict[str, Any]], rollouts: int) -> list[dict[str, Any]]:
    """The goals of issues 16 and 26 that the placements run allows to check (the lag and
    RSS bounds are meant at four times the seed's scale, the CPU and ship ratios at the
    default size, the idle ratio at `idle_target`)."""
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
        idle = statistics.median(celery["idle_seconds"]) / statistics.median(thread["idle_seconds"])
        target = idle_target(rollouts)
        goal(f"celery / thread median idle_seconds <= {target}", idle, target, idle <= target)
    if celery is not None and "inference" in celery:
        load, kept = celery["inference"], inference_target(rollouts)
        goal(
            f"celery inference throughput_kept >= {kept}",
            load["throughput_kept"],
            kept,
            load["throughput_kept"] >= kept,
        )
        inflation = load["latency_p99_inflation"]
        goal("celery inference request p99 inflation <= 1.1", inflation, 1.1, inflation <= 1.1)
    identical = all(r["steps_identical"] for r in results.values())
    goal("steps_identical", float(identical), 1.0, identical)
    return out


# Issue 36's bound on the inference throughput the celery placement keeps while it ships:
# 95% up to the seed's size (4,096 rollouts a step), 90% beyond.
def inference_target(rollouts: int) -> float:
    return 0.95 if rollouts <= 4096 else 0.9


# `--workload moe`: the placement the ratios divide by, the one the goals are about, and
# the thread placement beside them.
DENSE, BY_HANDLE, THREAD = "celery-dense", "celery-moe-handle", "thread-moe-inline"


def _median_ship(result: dict[str, Any]) -> float:
    return statistics.median(result["ship_seconds"])


# The ratios reported (no bound but the goals' own): each figure of every placement over
# celery-dense's (the same rollouts without routed experts) and over the thread placement's.
RATIO_FIGURES: dict[str, Any] = {
    "Redis peak (growth over the run's start)": lambda r: r["redis_peak_growth_bytes"],
    "median ship_seconds": _median_ship,
    "median idle_seconds": lambda r: statistics.median(r["idle_seconds"]),
    "CPU seconds per step (ship kinds)": lambda r: r["cpu_seconds_per_step"]["ship"],
    "orchestrator RSS growth": lambda r: r["orchestrator_rss_growth_bytes"],
}
RATIOS_OVER: dict[str, tuple[str, ...]] = {
    DENSE: tuple(RATIO_FIGURES)[:4],
    THREAD: tuple(RATIO_FIGURES)[1:],  # its Redis holds only the run's few small keys
}


def moe_ratios(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every placement's figures over celery-dense's and over the thread placement's."""
    out = []
    for base, figures in RATIOS_OVER.items():
        if base not in results:
            continue
        for name, result in results.items():
            if name == base:
                continue
            for figure in figures:
                of = RATIO_FIGURES[figure]
                value = of(result) / max(of(results[base]), 1e-9)
                out.append({"placement": name, "over": base, "figure": figure, "value": value})
    return out


def moe_goals(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The moe issue's goals, for the celery placement with routed experts by handle: Redis
    peak and ship time within 1.1x and 1.2x the same rollouts' without routed experts, and the
    loop's lag within bounds."""
    out: list[dict[str, Any]] = []

    def goal(name: str, value: float, target: float) -> None:
        out.append({"goal": name, "value": value, "target": target, "pass": bool(value <= target)})

    handle, dense = results.get(BY_HANDLE), results.get(DENSE)
    if handle is not None and dense is not None:
        redis = handle["redis_peak_growth_bytes"] / max(dense["redis_peak_growth_bytes"], 1)
        goal(f"{BY_HANDLE} / {DENSE} Redis peak (growth over the run's start) <= 1.1", redis, 1.1)
        ship = _median_ship(handle) / _median_ship(dense)
        goal(f"{BY_HANDLE} / {DENSE} median ship_seconds <= 1.2", ship, 1.2)
    if handle is not None:
        goal(f"{BY_HANDLE} lag_ms.max <= 20", handle["lag_ms"]["max"], 20.0)
        goal(f"{BY_HANDLE} lag_ms.p99 <= 5", handle["lag_ms"]["p99"], 5.0)
    if handle is not None and "inference" in handle:  # issue 36: 90% kept with the MoE workload
        kept = handle["inference"]["throughput_kept"]
        out.append(
            {
                "goal": f"{BY_HANDLE} inference throughput_kept >= 0.9",
                "value": kept,
                "target": 0.9,
                "pass": bool(kept >= 0.9),
            }
        )
    identical = all(r["steps_identical"] for r in results.values())
    out.append({"goal": "steps_identical", "value": float(identical), "target": 1.0, "pass": identical})
    return out


def durability_cost(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """What waiting for a replica costs (issue 27 asks it measured, sets no bound): the
    replicated placement over the plain one, median ship seconds and CPU per step."""
    plain, replicated = results.get("celery"), results.get("celery-replicated")
    if plain is None or replicated is None:
        return {}
    return ship_and_cpu_ratios(replicated, plain)


def ship_and_cpu_ratios(result: dict[str, Any], plain: dict[str, Any]) -> dict[str, float]:
    """A placement's median ship seconds and CPU per step (ship kinds) over the plain one's."""
    return {
        "ship_seconds_ratio": _median_ship(result) / _median_ship(plain),
        "cpu_seconds_per_step_ratio": result["cpu_seconds_per_step"]["ship"]
        / max(plain["cpu_seconds_per_step"]["ship"], 1e-9),
    }


TRACING_CPU_GOAL = 1.03


def tracing_cost(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """What tracing costs (issue 37: at most 3% more CPU per step): the traced placement
    over the plain one, CPU of the ship kinds per step's cycle (judged: all a step costs)
    and in its ship window (the median step), median ship seconds, and what the placement's
    processes exported. A window's CPU is not what a step costs: it leaves out the work
    around it (prepare, release) and takes in the next step's prepare for as long as the
    window lasts, so a placement whose window is longer is charged for work it did not add."""
    plain, traced = results.get("celery"), results.get("celery-traced")
    if plain is None or traced is None:
        return {}
    ratios = ship_and_cpu_ratios(traced, plain)

    def mean_ship(result: dict[str, Any]) -> float:
        return statistics.fmean(step["ship"] for step in result["cpu_seconds"])

    def cycle_ship(result: dict[str, Any]) -> float:
        return result["cpu_seconds_per_cycle"].get("ship", float("nan"))

    cycle_ratio = cycle_ship(traced) / max(cycle_ship(plain), 1e-9)
    return {
        **ratios,
        "cpu_seconds_mean_ratio": mean_ship(traced) / max(mean_ship(plain), 1e-9),
        "cpu_seconds_per_cycle_ratio": cycle_ratio,
        "cycles": [len(plain["cpu_cycles"]), len(traced["cpu_cycles"])],
        "cpu_goal": TRACING_CPU_GOAL,
        "cpu_goal_met": cycle_ratio <= TRACING_CPU_GOAL,
        "otlp_requests": traced.get("otlp_received", {}).get("requests", 0),
        "otlp_bytes": traced.get("otlp_received", {}).get("bytes", 0),
    }


CURVE_CPU_GOAL = 1.1


def curve_cost(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What `--zmq-curve` costs (issue 38: at most 1.1x the CPU per step without): the
    CURVE placement over the plain one, CPU per step of the ship kinds and median ship seconds."""
    plain, curve = results.get("celery"), results.get("celery-curve")
    if plain is None or curve is None:
        return {}
    ratios = ship_and_cpu_ratios(curve, plain)
    met = ratios["cpu_seconds_per_step_ratio"] <= CURVE_CPU_GOAL
    return {**ratios, "cpu_goal": CURVE_CPU_GOAL, "cpu_goal_met": met}


def summary_line(placement: str, result: dict[str, Any]) -> str:
    lag = result["lag_ms"]
    memory = ""
    if "redis_memory" in result:
        redis = result["redis_memory"]
        memory = (
            f"Redis peak {redis['peak_bytes'] / 2**20:.0f} MiB (+{redis['peak_growth_bytes'] / 2**20:.0f}; "
            f"{redis['peak_source']}) | "
            f"payload root peak {result['payload_root_peak_bytes'] / 2**20:.0f} MiB | "
        )
        if "payload_dir_peak_bytes" in result:
            memory += f"payload dir peak {result['payload_dir_peak_bytes'] / 2**20:.0f} MiB | "
    return (
        f"{placement}: lag p50 {lag['p50']:.2f} p99 {lag['p99']:.2f} max {lag['max']:.1f} ms | "
        f"heartbeat p95 {result['heartbeat_p95_ms']:.1f} max {result['heartbeat_max_ms']:.1f} ms | "
        f"ship {statistics.median(result['ship_seconds']):.2f} s (median) | "
        f"idle {statistics.median(result['idle_seconds']):.2f} s (median; last rollout to last rank "
        f"decoded: {', '.join(f'{t:.2f}' for t in result['idle_seconds'])}) | "
        f"peak RSS {result['orchestrator_peak_rss_bytes'] / 2**20:.0f} MiB "
        f"(+{result['orchestrator_rss_growth_bytes'] / 2**20:.0f} over imports) | "
        f"CPU {1000 * result['cpu_seconds_per_step']['ship']:.0f} ms a step | "
        + memory
        + inference_line(result)
        + f"identical {result['steps_identical']}"
    )


def inference_line(result: dict[str, Any]) -> str:
    if "inference" not in result:
        return ""
    load = result["inference"]
    shipping, baseline = load["shipping"], load["baseline"]
    return (
        f"inference C={load['concurrency']}: {shipping['requests_per_second']:.1f} req/s shipping, "
        f"{baseline['requests_per_second']:.1f} alone (kept {load['throughput_kept']:.2f}; tokens "
        f"{load['token_throughput_kept']:.2f}), latency p50/p99 x{load['latency_p50_inflation']:.2f}/"
        f"x{load['latency_p99_inflation']:.2f}, TTFT p99 {load['ttft_p99_ms']:.0f} ms "
        f"(x{load['ttft_p99_inflation']:.2f}) | "
    )


def print_report(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(
        f"\nworkload per step: {w['rollouts'][-1]} rollouts, {w['tokens'][-1]:,} tokens, "
        f"{w['wire_bytes'][-1] / 2**20:.1f} MiB on the wire (last step)"
    )
    if "routed_experts_bytes" in w:
        wire = ", ".join(f"{name} {b[-1] / 2**20:.1f}" for name, b in w["wire_bytes_by_placement"].items())
        print(f"  routed experts {w['routed_experts_bytes'][-1] / 2**20:.1f} MiB; on the wire (MiB): {wire}")
    for placement, result in report["placements"].items():
        print("  " + summary_line(placement, result))
    print_cpu_table(report["placements"])
    print_inference_table(report["placements"])
    if "ratios" in report:
        print_memory_table(report["placements"])
        print_ratios(report["ratios"])
    for goal in report["goals"]:
        print(f"  {'PASS' if goal['pass'] else 'MISS'}  {goal['goal']}: {goal['value']:.3g}")
    for placement, why in (report.get("stopped_for_memory") or {}).items():
        print(f"  STOPPED  {placement}: {why}")
    cost = report.get("durability_cost") or {}
    if cost:
        print(
            "  waiting for a replica (celery-replicated / celery): "
            f"ship time x{cost['ship_seconds_ratio']:.2f}, "
            f"CPU per step (ship kinds) x{cost['cpu_seconds_per_step_ratio']:.2f}"
        )
    curve = report.get("curve_cost") or {}
    if curve:
        print(
            f"  {'PASS' if curve['cpu_goal_met'] else 'MISS'}  CURVE on (celery-curve / celery): CPU per "
            f"step (ship kinds) x{curve['cpu_seconds_per_step_ratio']:.3f} (goal <= {CURVE_CPU_GOAL}), "
            f"ship time x{curve['ship_seconds_ratio']:.2f}"
        )
    traced = report.get("tracing_cost") or {}
    if traced:
        print(
            f"  {'PASS' if traced['cpu_goal_met'] else 'MISS'}  tracing on (celery-traced / celery): CPU per "
            f"step's cycle (ship kinds, cut to cut; {traced['cycles'][0]} and {traced['cycles'][1]} cycles) "
            f"x{traced['cpu_seconds_per_cycle_ratio']:.3f} (goal <= "
            f"{TRACING_CPU_GOAL}); in the ship window x{traced['cpu_seconds_per_step_ratio']:.3f} "
            f"(median step), x{traced['cpu_seconds_mean_ratio']:.3f} (mean), "
            f"ship time x{traced['ship_seconds_ratio']:.2f}; {traced['otlp_requests']} OTLP requests, "
            f"{traced['otlp_bytes'] / 1024:.0f} KiB"
        )
    print(f"  other processes used {report['machine']['other_cpu_share']:.0%} of the CPU meanwhile")


def print_memory_table(placements: dict[str, dict[str, Any]]) -> None:
    """Per placement, MiB: Redis's peak used memory (and over the run's start), the payload
    directories' peak bytes, the orchestrator's RSS growth; then lag and ship time."""
    print(
        "\n  MiB: Redis peak (growth) | payload root peak | payload dir peak | orchestrator RSS growth"
        " || lag max / p99 ms | ship s median | CPU ms a step"
    )
    for name, r in placements.items():
        print(
            f"  {name:>22}: {r['redis_peak_used_memory_bytes'] / 2**20:9.1f} "
            f"({r['redis_peak_growth_bytes'] / 2**20:.1f}) | {r['payload_root_peak_bytes'] / 2**20:9.1f} | "
            f"{r.get('payload_dir_peak_bytes', 0) / 2**20:9.1f} | "
            f"{r['orchestrator_rss_growth_bytes'] / 2**20:7.1f} || {r['lag_ms']['max']:.1f} / "
            f"{r['lag_ms']['p99']:.2f} | {_median_ship(r):.2f} | "
            f"{1000 * r['cpu_seconds_per_step']['ship']:.0f}"
        )


def print_ratios(ratios: list[dict[str, Any]]) -> None:
    """The ratios, grouped by what they divide by."""
    for over in dict.fromkeys(r["over"] for r in ratios):
        print(f"\n  over {over}:")
        rows: dict[str, list[str]] = {}
        for ratio in (r for r in ratios if r["over"] == over):
            rows.setdefault(ratio["placement"], []).append(f"{ratio['figure']} x{ratio['value']:.2f}")
        for placement, figures in rows.items():
            print(f"  {placement:>22}: " + "; ".join(figures))


def print_cpu_table(placements: dict[str, dict[str, Any]]) -> None:
    """CPU milliseconds per measured step (`median_step`) by process kind; `ship` sums the
    orchestrator, the workers and Redis; trainer ranks and other programs apart."""
    columns = [*SHIP_KINDS, "ship", "trainers", "others"]
    print("\n  CPU ms per step (the step of median ship CPU): " + " | ".join(columns))
    for placement, result in placements.items():
        cpu = result["cpu_seconds_per_step"]
        print(f"  {placement:>17}: " + " | ".join(f"{1000 * cpu.get(c, 0.0):7.0f}" for c in columns))
    print("  CPU ms per step's cycle (a cut to the next, the mean): " + " | ".join(columns))
    for placement, result in placements.items():
        cpu = result["cpu_seconds_per_cycle"]
        print(f"  {placement:>17}: " + " | ".join(f"{1000 * cpu.get(c, 0.0):7.0f}" for c in columns))
