"""`rlship bench loop` at a tiny size: all three placements with real trainer ranks and real
Celery workers, checked for the figures it reports and for identical payloads (no timing
asserts: figures at this size say nothing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.commands.cli import main
from tests.support.processes import require_module

pytestmark = pytest.mark.timeout(120)

PLACEMENT_KEYS = {
    "lag_ms",
    "heartbeat_p95_ms",
    "heartbeat_max_ms",
    "ship_seconds",
    "idle_seconds",
    "orchestrator_peak_rss_bytes",
    "tokens_shipped",
    "steps_identical",
}


@pytest.fixture(scope="module")
def bench(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("bench-loop") / "loop.json"
    argv = [
        "--rollouts",
        "32",
        "--seq-len",
        "512",
        "--ranks",
        "2",
        "--steps",
        "1",
        "--warmup-steps",
        "0",
        "--timeout",
        "90",
    ]
    return main(["bench", "loop", "--json", str(out), *argv]), out


@pytest.fixture(scope="module")
def report(bench: tuple[int, Path]) -> dict[str, Any]:
    return json.loads(bench[1].read_text())


def test_every_placement_ships_identical_payloads(bench: tuple[int, Path], report: dict[str, Any]) -> None:
    assert bench[0] == 0
    assert report["steps_identical"] is True
    workload = report["workload"]
    assert workload["rollouts"] == [32]
    assert workload["tokens"][0] > 0 and workload["wire_bytes"][0] > 0
    assert list(report["placements"]) == ["inline", "thread", "celery"]
    for name, placement in report["placements"].items():
        assert set(placement) >= PLACEMENT_KEYS, name
        assert set(placement["lag_ms"]) == {"p50", "p95", "p99", "max"}
        assert placement["steps_identical"] is True, name
        assert placement["tokens_shipped"] == workload["tokens"][0], name
        assert len(placement["ship_seconds"]) == 1 and placement["ship_seconds"][0] > 0
        # Heard from the last rank's policy announcement after the step's last rollout arrived.
        assert len(placement["idle_seconds"]) == 1
        assert 0 < placement["idle_seconds"][0] < report["wall_seconds"], name
        assert placement["orchestrator_peak_rss_bytes"] > 0
    assert {goal["goal"] for goal in report["goals"]} >= {"steps_identical"}


def test_cpu_per_step_by_process_kind(report: dict[str, Any]) -> None:
    """Every placement reports CPU seconds per measured step for each process kind; the
    ship total is its three kinds; only the celery placement has workers. (A kind's CPU
    is counted in 10 ms ticks: at this size the orchestrator's or Redis's may be 0.)"""
    kinds = {"orchestrator", "workers", "redis", "trainers", "others", "ship"}
    for name, placement in report["placements"].items():
        assert len(placement["cpu_seconds"]) == len(placement["ship_seconds"]), name
        for figures in [*placement["cpu_seconds"], placement["cpu_seconds_per_step"]]:
            assert set(figures) == kinds, name
            assert all(value >= 0 for value in figures.values()), (name, figures)
            ship = figures["orchestrator"] + figures["workers"] + figures["redis"]
            assert figures["ship"] == pytest.approx(ship), name
        # Within the window, not since the process started: no more than the cores could give
        # (plus the 10 ms ticks' rounding at the window's two ends, per process).
        cores = report["machine"]["cpus"]
        for figures, window in zip(placement["cpu_seconds"], placement["ship_seconds"], strict=True):
            assert figures["ship"] <= cores * window + 0.5, (name, figures, window)
    assert report["placements"]["inline"]["cpu_seconds_per_step"]["workers"] == 0
    assert report["placements"]["thread"]["cpu_seconds_per_step"]["workers"] == 0
    celery = report["placements"]["celery"]["cpu_seconds_per_step"]
    assert celery["workers"] > 0


def test_lag_figure_beside_the_json(bench: tuple[int, Path]) -> None:
    require_module("matplotlib")
    png = bench[1].with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
