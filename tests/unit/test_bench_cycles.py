"""What tracing costs, judged per step's cycle (`rlship bench loop`, issue 37): a placement
named again in one bench pools its cycles with its earlier rounds', and the goal is judged
on the mean CPU a cycle. The figures are written here by hand and the means worked out by
hand, not by the bench's helpers."""

from __future__ import annotations

import pytest

from orchestrator.commands.bench.summary import pool_rounds, summarize, tracing_cost


def step(ship: float) -> dict[str, float]:
    """CPU seconds of one window or cycle: the ship total split over its three kinds."""
    return {"orchestrator": ship / 4, "workers": ship / 2, "redis": ship / 4, "ship": ship, "trainers": 0.0}


def raw(windows: list[float], cycles: list[float]) -> dict:
    """One placement's raw figures: steps 0.. with the ship CPU of each window, and of each
    step's cycle but the last's (a cycle runs to the next cut)."""
    steps = range(len(windows))
    return {
        "windows": {str(s): [10.0 * s, 10.0 * s + 1.0] for s in steps},
        "records": [{"step": s} for s in steps],
        "received": {},
        "cpu": {str(s): step(ship) for s, ship in zip(steps, windows, strict=True)},
        "cpu_cycles": {str(s): step(ship) for s, ship in zip(steps, cycles, strict=False)},
        "idle_seconds": {},
        "heartbeat": {"t": [], "ms": []},
        "lag": {"t": [], "ms": []},
        "baseline_rss_bytes": 0,
        "peak_rss_bytes": 0,
        "origin": 0.0,
    }


def summary(windows: list[float], cycles: list[float], warmup: int = 0) -> dict:
    no_ranks = {"checksums": [[]], "rows_checksums": [[]]}
    result = summarize(raw(windows, cycles), no_ranks, warmup)
    result["ship_seconds"] = [1.0] * len(result["cpu_seconds"])
    return result


def test_cycles_after_the_warmup_only() -> None:
    result = summary([0.9, 0.2, 0.3, 0.4], [0.8, 0.5, 0.7], warmup=1)
    assert [c["ship"] for c in result["cpu_cycles"]] == [0.5, 0.7]
    assert result["cpu_seconds_per_cycle"]["ship"] == pytest.approx(0.6)
    assert result["rounds"] == 1


def test_rounds_pool_their_cycles_and_the_goal_is_judged_on_them() -> None:
    # Plain: cycles 0.50, 0.52 then 0.48, 0.50: a mean of 0.50. Traced: 0.52, 0.51 then
    # 0.50, 0.52: 0.5125, 1.025x. The traced placement's last window (1.3 over 1.0) would miss.
    plain = pool_rounds(summary([1.0, 1.0, 1.0], [0.50, 0.52]), summary([1.0, 1.0, 1.0], [0.48, 0.50]))
    traced = pool_rounds(summary([1.3, 1.3, 1.3], [0.52, 0.51]), summary([1.3, 1.3, 1.3], [0.50, 0.52]))
    assert plain["rounds"] == traced["rounds"] == 2
    cost = tracing_cost({"celery": plain, "celery-traced": traced})
    assert cost["cycles"] == [4, 4]
    assert cost["cpu_seconds_per_cycle_ratio"] == pytest.approx(1.025)
    assert cost["cpu_goal_met"]
    assert cost["cpu_seconds_per_step_ratio"] == pytest.approx(1.3)

    heavier = pool_rounds(traced, summary([1.0, 1.0], [0.60]))
    cost = tracing_cost({"celery": plain, "celery-traced": heavier})
    assert cost["cycles"] == [4, 5]
    assert cost["cpu_seconds_per_cycle_ratio"] == pytest.approx((0.52 + 0.51 + 0.50 + 0.52 + 0.60) / 5 / 0.50)
    assert not cost["cpu_goal_met"]
