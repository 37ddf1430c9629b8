"""The figures of the orchestrator loop's inference load (`inference.InferenceLoad`) in
`rlship bench loop --inference-concurrency`, and their table in the report.

The requests that completed (whose first token arrived) inside the measured ship windows
are compared with those of the baseline, the load alone before the placement shipped:
requests completed and tokens received per second, request latency and time to first
token. Selecting by completion time keeps both sets' answer lengths distributed as all
answers' are (selecting the requests that overlap a window would favour long ones).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np


def _within(times: np.ndarray, spans: list[tuple[float, float]]) -> np.ndarray:
    keep = np.zeros(len(times), dtype=bool)
    for start, end in spans:
        keep |= (times >= start) & (times <= end)
    return keep


def _percentiles_ms(seconds: np.ndarray) -> dict[str, float]:
    if not len(seconds):
        return {"p50": float("nan"), "p99": float("nan")}
    p50, p99 = np.percentile(seconds * 1000.0, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def phase_figures(raw: dict[str, Any], spans: list[tuple[float, float]]) -> dict[str, Any]:
    """The load's figures over these spans: requests completed and tokens received per
    second, the latency of the requests completed in them, the time to first token of
    those whose first token came in them."""
    started, first, ended = (
        np.asarray(raw[name], np.float64) for name in ("started", "first_token", "ended")
    )
    seconds = sum(end - start for start, end in spans)
    completed = _within(ended, spans)
    width = raw["token_bin_seconds"]
    bins = np.asarray(raw["token_bins"], np.int64)
    tokens = int(bins[_within((np.arange(len(bins)) + 0.5) * width, spans)].sum())
    return {
        "seconds": seconds,
        "requests_completed": int(completed.sum()),
        "requests_per_second": float(completed.sum() / seconds) if seconds else float("nan"),
        "tokens_per_second": tokens / seconds if seconds else float("nan"),
        "latency_ms": _percentiles_ms((ended - started)[completed]),
        "ttft_ms": _percentiles_ms((first - started)[_within(first, spans)]),
    }


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def _counting_error(*counts: int) -> float:
    return math.sqrt(sum(1.0 / count for count in counts)) if all(counts) else float("nan")


def inference_figures(raw: dict[str, Any], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """The load while shipping (the measured ship windows, in order) against the load alone
    (the baseline), and what shipping kept of it; and over the shipping period, from the
    first measured cut to the last measured record, the waits between steps included (what
    a run's average feels; the windows are short at small sizes, and so are their counts)."""
    if raw["baseline"] is None:
        raise ValueError("inference: the load has no baseline phase (it failed before shipping began)")
    baseline = phase_figures(raw, [tuple(raw["baseline"])])
    shipping = phase_figures(raw, windows)
    period = phase_figures(raw, [(windows[0][0], windows[-1][1])] if windows else [])
    kept = _ratio(shipping["requests_per_second"], baseline["requests_per_second"])
    return {
        "concurrency": raw["spec"]["concurrency"],
        "baseline": baseline,
        "shipping": shipping,
        "shipping_period": period,
        "throughput_kept": kept,
        "period_throughput_kept": _ratio(period["requests_per_second"], baseline["requests_per_second"]),
        # One standard deviation of `throughput_kept` from counting alone (completions taken as
        # Poisson): the windows of a few steps hold a few hundred requests, +-5% or so.
        "throughput_kept_counting_error": kept
        * _counting_error(shipping["requests_completed"], baseline["requests_completed"]),
        "token_throughput_kept": _ratio(shipping["tokens_per_second"], baseline["tokens_per_second"]),
        "latency_p50_inflation": _ratio(shipping["latency_ms"]["p50"], baseline["latency_ms"]["p50"]),
        "latency_p99_inflation": _ratio(shipping["latency_ms"]["p99"], baseline["latency_ms"]["p99"]),
        "ttft_p99_ms": shipping["ttft_ms"]["p99"],
        "ttft_p99_inflation": _ratio(shipping["ttft_ms"]["p99"], baseline["ttft_ms"]["p99"]),
        "requests_completed": len(raw["ended"]),
        "rollouts_kept": raw["rollouts_kept"],
    }


def print_inference_table(placements: dict[str, dict[str, Any]]) -> None:
    """Per placement with an inference load: requests per second alone and while shipping,
    what shipping kept, latency and time to first token, the loop's lag, the trainer's idle."""
    loads = {name: r["inference"] for name, r in placements.items() if "inference" in r}
    if not loads:
        return
    print(
        f"\n  inference, C={next(iter(loads.values()))['concurrency']}: req/s alone -> shipping (kept; tokens"
        " kept; kept over the shipping period) | latency p50 / p99 ms alone -> shipping | TTFT p99 ms"
        " alone -> shipping | lag p99 / max ms alone -> shipping | trainer idle s median"
        " | mock server CPU ms a step"
    )
    for name, load in loads.items():
        alone, shipping = load["baseline"], load["shipping"]
        idle = load["trainer_idle_seconds"]
        print(
            f"  {name:>22}: {alone['requests_per_second']:.1f} -> {shipping['requests_per_second']:.1f} "
            f"({load['throughput_kept']:.2f} +-{load['throughput_kept_counting_error']:.2f}; "
            f"{load['token_throughput_kept']:.2f}; "
            f"{load['period_throughput_kept']:.2f}) | "
            f"{alone['latency_ms']['p50']:.0f} / {alone['latency_ms']['p99']:.0f} -> "
            f"{shipping['latency_ms']['p50']:.0f} / {shipping['latency_ms']['p99']:.0f} | "
            f"{alone['ttft_ms']['p99']:.0f} -> {shipping['ttft_ms']['p99']:.0f} | "
            f"{load['baseline_lag_ms']['p99']:.1f} / {load['baseline_lag_ms']['max']:.1f} -> "
            f"{load['lag_ms']['p99']:.1f} / {load['lag_ms']['max']:.1f} | "
            f"{statistics.median(idle) if idle else float('nan'):.2f} | "
            f"{1000 * placements[name]['cpu_seconds_per_step'].get('inference-server', 0.0):.0f}"
        )
