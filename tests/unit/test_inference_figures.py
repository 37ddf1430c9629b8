"""The inference load's figures (`rlship bench loop --inference-concurrency`) from a load
written by hand: which requests count in which phase, counted here by hand from the rule
the bench states (a request counts where it completed; its time to first token where its
first token came; tokens where they were received)."""

from __future__ import annotations

import math

import pytest

from orchestrator.commands.bench.inference_figures import inference_figures


def load() -> dict:
    """Six requests: three completed in the baseline [0, 10], two in the windows [20, 21]
    and [30, 32], one between them; tokens received in 10 ms bins."""
    started = [0.0, 2.0, 5.0, 18.0, 29.0, 22.0]
    first = [0.5, 2.5, 5.5, 20.5, 30.5, 22.5]  # the 4th's and 5th's first tokens in the windows
    ended = [4.0, 6.0, 9.0, 20.8, 31.0, 25.0]  # the 6th completed between the windows
    bins = [0] * 3300
    bins[100] = 40  # t = 1.005: baseline
    bins[900] = 60  # t = 9.005: baseline
    bins[2050] = 30  # t = 20.505: first window
    bins[3100] = 15  # t = 31.005: second window
    bins[2500] = 99  # t = 25.005: between the windows, in the shipping period only
    return {
        "spec": {"concurrency": 3},
        "baseline": [0.0, 10.0],
        "started": started,
        "first_token": first,
        "ended": ended,
        "tokens": [10, 20, 30, 40, 50, 60],
        "token_bins": bins,
        "token_bin_seconds": 0.01,
        "rollouts_kept": 6,
    }


def test_requests_count_where_they_completed() -> None:
    figures = inference_figures(load(), [(20.0, 21.0), (30.0, 32.0)])
    baseline, shipping, period = figures["baseline"], figures["shipping"], figures["shipping_period"]
    assert baseline["seconds"] == 10.0 and shipping["seconds"] == 3.0 and period["seconds"] == 12.0
    assert baseline["requests_completed"] == 3 and baseline["requests_per_second"] == pytest.approx(0.3)
    assert shipping["requests_completed"] == 2 and shipping["requests_per_second"] == pytest.approx(2 / 3)
    assert period["requests_completed"] == 3  # the one between the windows too
    assert figures["throughput_kept"] == pytest.approx((2 / 3) / 0.3)
    assert figures["period_throughput_kept"] == pytest.approx((3 / 12) / 0.3)
    assert figures["throughput_kept_counting_error"] == pytest.approx(
        (2 / 3) / 0.3 * math.sqrt(1 / 2 + 1 / 3)
    )
    assert baseline["tokens_per_second"] == pytest.approx(100 / 10)
    assert shipping["tokens_per_second"] == pytest.approx(45 / 3)
    assert period["tokens_per_second"] == pytest.approx(144 / 12)
    assert figures["token_throughput_kept"] == pytest.approx(15 / 10)
    # Latencies 4, 4, 4 s alone; 2.8 and 2 s in the windows (numpy's linear percentiles).
    assert baseline["latency_ms"] == pytest.approx({"p50": 4000.0, "p99": 4000.0})
    assert shipping["latency_ms"]["p50"] == pytest.approx(2400.0)
    assert shipping["latency_ms"]["p99"] == pytest.approx(2000.0 + 0.99 * 800.0)
    assert figures["latency_p99_inflation"] == pytest.approx((2000.0 + 0.99 * 800.0) / 4000.0)
    # In the baseline every first token came 0.5 s after its request.
    assert baseline["ttft_ms"]["p99"] == pytest.approx(500.0)
    # In the windows: the 4th's (2.5 s: its request began before its window) and the 5th's (1.5 s).
    assert shipping["ttft_ms"] == pytest.approx({"p50": 2000.0, "p99": 1500.0 + 0.99 * 1000.0})
    assert figures["ttft_p99_ms"] == shipping["ttft_ms"]["p99"]
    assert figures["requests_completed"] == 6 and figures["rollouts_kept"] == 6


def test_a_phase_without_requests_has_no_percentiles() -> None:
    figures = inference_figures(load(), [(40.0, 41.0)])
    shipping = figures["shipping"]
    assert shipping["requests_completed"] == 0 and shipping["requests_per_second"] == 0.0
    assert math.isnan(shipping["latency_ms"]["p99"]) and math.isnan(figures["ttft_p99_ms"])
    assert figures["throughput_kept"] == 0.0 and math.isnan(figures["throughput_kept_counting_error"])


def test_a_load_that_never_reached_shipping_is_refused() -> None:
    raw = load() | {"baseline": None}
    with pytest.raises(ValueError, match="baseline"):
        inference_figures(raw, [(20.0, 21.0)])
