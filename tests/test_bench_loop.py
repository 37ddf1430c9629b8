"""`rlship bench loop` at a tiny size: all three placements with real trainer ranks and real
Celery workers, checked for the figures it reports and for identical payloads (no timing
asserts: figures at this size say nothing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import main
from tests.conftest import require_module

pytestmark = pytest.mark.timeout(120)

PLACEMENT_KEYS = {
    "lag_ms",
    "heartbeat_p95_ms",
    "heartbeat_max_ms",
    "ship_seconds",
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
        assert placement["orchestrator_peak_rss_bytes"] > 0
    assert {goal["goal"] for goal in report["goals"]} >= {"steps_identical"}


def test_lag_figure_beside_the_json(bench: tuple[int, Path]) -> None:
    require_module("matplotlib")
    png = bench[1].with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
