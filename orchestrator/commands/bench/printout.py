"""The printed report of `rlship bench loop`: a line per placement, the CPU, inference,
memory and ratio tables, and each goal's PASS or MISS, from the figures `summary` made."""

from __future__ import annotations

import statistics
from typing import Any

from orchestrator.commands.bench.cpu import SHIP_KINDS
from orchestrator.commands.bench.inference_figures import print_inference_table
from orchestrator.commands.bench.summary import CURVE_CPU_GOAL, TRACING_CPU_GOAL, median_ship


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
            f"{r['lag_ms']['p99']:.2f} | {median_ship(r):.2f} | "
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
