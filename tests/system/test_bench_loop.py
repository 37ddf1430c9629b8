"""`rlship bench loop` at a tiny size: all three placements with real trainer ranks and real
Celery workers, checked for the figures it reports and for identical payloads (no timing
asserts: figures at this size say nothing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from orchestrator.commands.bench.memory import DirectoryBytes, MemoryWatch
from orchestrator.commands.cli import main
from tests.support.processes import require_module
from transport.payload_segments import write_segment_file

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


# -- --workload moe ----------------------------------------------------------------------------

MOE_KEYS = {
    "redis_peak_used_memory_bytes",
    "redis_peak_growth_bytes",
    "payload_root_peak_bytes",
    "redis_memory",
    "directories",
    "variant",
}


@pytest.fixture(scope="module")
def moe_report(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench-loop-moe") / "loop.json"
    argv = ["--workload", "moe", "--rollouts", "32", "--seq-len", "512", "--ranks", "2"]
    argv += ["--steps", "1", "--warmup-steps", "0", "--timeout", "90"]
    assert main(["bench", "loop", "--json", str(out), *argv]) == 0
    # The step cache and every run's rows and payload files are gone with the runs.
    assert not (out.parent / "steps").exists()
    assert not any(path.is_file() for path in out.parent.rglob("*.rows"))
    return json.loads(out.read_text())


@pytest.mark.timeout(400)
def test_moe_variants_ship_the_same_rollouts(moe_report: dict[str, Any]) -> None:
    """Every variant ships the reference's bytes (and the by-handle one's ranks read the
    reference's rows); all carry the same tokens, the routed experts travel only where the
    variant says."""
    assert moe_report["steps_identical"] is True
    workload, placements = moe_report["workload"], moe_report["placements"]
    assert list(placements) == [
        "thread-moe-inline",
        "celery-dense",
        "celery-moe-handle",
        "celery-moe-inline",
        "celery-moe-inline-dir",
    ]
    experts = workload["routed_experts_bytes"][0]
    assert experts == 384 * workload["tokens"][0]
    wire = {name: sizes[0] for name, sizes in workload["wire_bytes_by_placement"].items()}
    assert wire["celery-moe-inline"] == wire["thread-moe-inline"] == wire["celery-moe-inline-dir"]
    assert wire["celery-moe-inline"] > wire["celery-dense"] + experts
    assert wire["celery-dense"] < wire["celery-moe-handle"] < wire["celery-dense"] + experts
    for name, placement in placements.items():
        assert set(placement) >= PLACEMENT_KEYS | MOE_KEYS, name
        assert placement["steps_identical"] is True, name
        assert placement["tokens_shipped"] == workload["tokens"][0], name
    assert placements["celery-moe-handle"]["variant"] == {
        "placement": "celery",
        "routed_experts": "handle",
        "workload": "moe",
        "wire": "prime-rl-0f59b24",
    }
    assert placements["celery-moe-inline-dir"]["variant"]["payload_store"] == "dir"


@pytest.mark.timeout(400)
def test_moe_memory_figures(moe_report: dict[str, Any]) -> None:
    """Redis's peak is present and positive on each variant's own server (its own peak, as
    Redis tracks it); rows files count under the payload root only where routed experts
    pass through files: one step's worth here."""
    placements = moe_report["placements"]
    experts = moe_report["workload"]["routed_experts_bytes"][0]
    for name, placement in placements.items():
        redis = placement["redis_memory"]
        assert redis["server"] == "own" and redis["peak_source"] == "used_memory_peak", name
        assert placement["redis_peak_used_memory_bytes"] == redis["peak_bytes"] > 0, name
        assert redis["peak_bytes"] >= redis["sampled_max_bytes"] >= redis["baseline_bytes"] > 0, name
        assert placement["redis_peak_growth_bytes"] == redis["peak_bytes"] - redis["baseline_bytes"], name
        assert redis["samples"] > 1 and redis["interval_seconds"] > 0, name
        assert len(redis["timeline"]["t"]) == len(redis["timeline"]["mib"]) > 1, name
        assert placement["directories"]["overflows"] == 0, name
        assert len(placement["directories"]["timeline"]["t"]) > 1, name
    for name in ("thread-moe-inline", "celery-dense", "celery-moe-inline"):
        assert placements[name]["payload_root_peak_bytes"] == 0, name
    assert placements["celery-moe-handle"]["payload_root_peak_bytes"] == experts
    directory = placements["celery-moe-inline-dir"]
    assert directory["payload_root_peak_bytes"] == experts  # inline rows wait for the cut in files
    assert directory["payload_dir_peak_bytes"] > experts  # the payloads, routed experts inline
    # Inline through Redis, the routed experts are there twice (rollouts, then payloads).
    inline, handle = placements["celery-moe-inline"], placements["celery-moe-handle"]
    assert inline["redis_peak_growth_bytes"] > handle["redis_peak_growth_bytes"] + experts


@pytest.mark.timeout(400)
def test_moe_goals_and_ratios(moe_report: dict[str, Any]) -> None:
    goals = {goal["goal"]: goal for goal in moe_report["goals"]}
    assert set(goals) == {
        "celery-moe-handle / celery-dense Redis peak (growth over the run's start) <= 1.1",
        "celery-moe-handle / celery-dense median ship_seconds <= 1.2",
        "celery-moe-handle lag_ms.max <= 20",
        "celery-moe-handle lag_ms.p99 <= 5",
        "steps_identical",
    }
    assert all(goal["value"] > 0 for goal in goals.values())
    ratios = moe_report["ratios"]
    assert {(r["placement"], r["over"]) for r in ratios} >= {
        ("celery-moe-handle", "celery-dense"),
        ("celery-moe-inline", "celery-dense"),
        ("celery-moe-handle", "thread-moe-inline"),
    }
    assert all(r["value"] > 0 for r in ratios)


def test_directory_bytes_follows_files_as_runs_write_them(tmp_path: Path) -> None:
    """Rows files written as the producer writes them (a temporary file linked into place),
    a payload renamed into a step directory made after the watch began, deletions: each file
    counted once, the peak kept, files outside the named directories not counted. (A file
    counts once the watcher has seen it: here it is given the time, in a run files live for
    a step.)"""
    rows, payloads = tmp_path / "payloads" / "run", tmp_path / "out" / "step-payloads" / "run"
    (tmp_path / "payloads" / "another-run").mkdir(parents=True)
    (tmp_path / "payloads" / "another-run" / "x.rows").write_bytes(b"x" * 999)
    watch = DirectoryBytes({"payload_root": rows, "payload_dir": payloads}).start()

    def settled(expected: dict[str, int]) -> None:
        deadline = time.monotonic() + 10
        while watch.bytes != expected and time.monotonic() < deadline:
            time.sleep(0.02)

    rows.mkdir()
    for index in range(20):
        write_segment_file(rows / f"r{index}.rows", {"routed_experts": np.zeros((100, 48, 8), np.uint8)})
    (payloads / "step_0").mkdir(parents=True)
    temporary = payloads / "step_0" / ".rank_0.tmp"
    temporary.write_bytes(b"p" * 5000)
    os.replace(temporary, payloads / "step_0" / "rank_0.bin")
    settled({"payload_root": 20 * 38400, "payload_dir": 5000})
    for index in range(5):
        (rows / f"r{index}.rows").unlink()
    shutil.rmtree(payloads / "step_0")
    settled({"payload_root": 15 * 38400, "payload_dir": 0})
    figures = watch.stop()
    assert figures["end_bytes"] == {"payload_root": 15 * 38400, "payload_dir": 0}
    assert figures["peak_bytes"] == {"payload_root": 20 * 38400, "payload_dir": 5000}
    assert figures["peak_total_bytes"] == 20 * 38400 + 5000
    assert figures["overflows"] == 0


def test_memory_watch_stops_the_placement_s_processes() -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        watch = MemoryWatch(psutil.virtual_memory().total + 1, lambda: [victim], interval=0.01).start()
        assert victim.wait(10) != 0
        watch.stop()
        assert watch.tripped is not None and "--min-available-mib" in watch.tripped
    finally:
        victim.kill()
        victim.wait()


def test_traced_and_curve_placements_beside_celery_report_what_they_cost(tmp_path: Path) -> None:
    """The traced placement's processes export to the bench's sink (requests counted, so a
    placement that did not trace shows 0); the CURVE placement runs with `zmq_curve` and its
    run's keys; the report divides each one's CPU per step by the plain placement's (issues
    37's and 38's goals, no timing asserted at this size)."""
    out = tmp_path / "loop.json"
    argv = [
        "--placements", "celery,celery-traced,celery-curve", "--rollouts", "32", "--seq-len", "512",
        "--ranks", "2", "--steps", "2", "--warmup-steps", "0",
    ]  # fmt: skip
    done = main(["bench", "loop", "--json", str(out), *argv])
    report = json.loads(out.read_text())
    assert done == 0 and report["steps_identical"]
    cost = report["tracing_cost"]
    assert cost["otlp_requests"] > 0 and cost["otlp_bytes"] > 0, "the traced placement's processes exported"
    assert cost["cpu_seconds_per_step_ratio"] > 0 and cost["cpu_goal"] == 1.03
    # Two steps: one cycle (the first cut to the second) for each placement, judged on it.
    assert cost["cycles"] == [1, 1] and cost["cpu_seconds_per_cycle_ratio"] > 0
    assert "otlp_received" not in report["placements"]["celery"]
    curve = report["curve_cost"]
    assert curve["cpu_seconds_per_step_ratio"] > 0 and curve["cpu_goal"] == 1.1
    spec_files = tmp_path.glob("logs/*/spec.json")
    specs = {path.parent.name: json.loads(path.read_text())["settings"] for path in spec_files}
    assert specs["celery-curve"]["zmq_curve"] and not specs["celery"]["zmq_curve"]
    keys = Path(specs["celery-curve"]["zmq_keys_dir"])
    assert {path.name for path in keys.iterdir()} >= {"server.key_secret", "rank-0.key", "rank-1.key"}, keys


def test_bench_tracing_reports_cpu_a_task_in_each_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """`rlship bench tracing`: rlship's task spans against the SDK's, each mode's CPU a task
    (and its Redis's), a step's and their ratio, its spans received by the bench's sink (so
    the measured processes did trace, and through Redis)."""
    assert main(["bench", "tracing", "--tasks", "20", "--rounds", "1", "--ranks", "2"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    modes = {"task-spans", "sdk"}
    assert set(report["cpu_ms_per_task"]) == set(report["redis_cpu_ms_per_task"]) == modes
    assert all(len(v) == 1 and v[0] > 0 for v in report["cpu_ms_per_task"].values())
    assert all(v[0] > 0 for v in report["redis_cpu_ms_per_task"].values()), "a mode's spans skipped Redis"
    # finalize (prune and pack in its task), metrics, an encode and a send a rank, publish, release
    assert report["tasks_a_step"] == 2 + 2 * 2 + 2
    # Relayed: a request a mode at least, each task's two spans (about 300 bytes) in them.
    assert report["otlp_received"]["requests"] >= 2 and report["otlp_received"]["bytes"] > 2 * 21 * 300
    medians = {
        mode: report["cpu_ms_per_task"][mode][0] + report["redis_cpu_ms_per_task"][mode][0] for mode in modes
    }
    assert report["task_spans_against_sdk"] == pytest.approx(medians["task-spans"] / medians["sdk"], rel=1e-3)
