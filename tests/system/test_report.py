"""`rlship report RUN_DIR`: from the metrics.jsonl of a real short run, valid PNG charts and a
report.html that shows them; a run still being written, or none, is handled."""

from __future__ import annotations

import json
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from orchestrator.commands.cli import main as rlship
from orchestrator.commands.report import (
    CHARTS,
    WAITING,
    load_records,
    spread,
    stage_names,
    stage_stack,
    summary_rows,
)
from tests.support.processes import REPO, Workers, python_command
from tests.support.shiprun import ship, ship_settings


class Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.sources.append(dict(attrs)["src"] or "")


def test_report_from_a_real_run(
    workers: Workers, redis_url: str, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = ship_settings(run_id, redis_url, workers, tmp_path / "run", steps=3)
    assert ship(settings).summary["steps_shipped"] == 3
    run_dir = Path(settings.output_dir)
    capsys.readouterr()

    assert rlship(["report", str(run_dir)]) == 0

    page = run_dir / "report.html"
    written = capsys.readouterr().out.split()
    assert written == [str(page), *(str(run_dir / name) for name in CHARTS)]
    images = Images()
    images.feed(page.read_text())
    assert images.sources == list(CHARTS)
    for name in CHARTS:
        with Image.open(run_dir / name) as image:
            image.verify()
            assert image.format == "PNG" and image.size[0] >= 600 and image.size[1] >= 300
    text = page.read_text()
    assert "rollouts shipped" in text and "balanced" in text
    assert f"<title>rlship report: {run_id}</title>" in text, "the page names the run, not its directory"


def test_stage_order_and_summary(tmp_path: Path) -> None:
    """Stages stack in pipeline order; a step whose `all` subset is empty leaves a gap, not an
    error; the summary reads the run totals of the last record."""
    records = [
        {"step": 0.0, "time/send": 0.1, "time/finalize": 0.2, "time/ship": 0.5, "time/wait_for_policy": 0.0,
         "time/encode": 0.1, "accounting/arrived": 40.0, "accounting/shipped": 16.0,
         "accounting/discarded/zero_advantage": 8.0, "accounting/balanced": 1.0,
         "train/agg/all/reward/mean": 0.5, "event_loop_lag/max_ms": 3.0},
        {"step": 1.0, "time/send": 0.1, "time/finalize": 0.2, "time/ship": 0.7, "time/wait_for_policy": 0.1,
         "time/encode": 0.1, "accounting/arrived": 80.0, "accounting/shipped": 32.0,
         "accounting/discarded/zero_advantage": 20.0, "accounting/discarded/stale": 4.0,
         "accounting/balanced": 1.0, "event_loop_lag/max_ms": 9.5},
    ]  # fmt: skip
    assert stage_names(records) == ["finalize", "encode", "send"]
    names, seconds = stage_stack(records)
    assert names == ["finalize", "encode", "send", WAITING]
    assert [round(s, 9) for s in seconds[-1]] == [0.1, 0.3], "the rest of cut → publish: 0.5 - 0.4, 0.7 - 0.4"
    rows = dict(summary_rows(records))
    assert rows["rollouts shipped"] == "32"
    assert rows["discarded"] == "stale 4, zero_advantage 20"
    assert rows["cut → publish"] == "mean 0.600 s, max 0.700 s"
    assert rows["event-loop lag"] == "max 9.5 ms"
    assert rows["accounting"] == "balanced"

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in reversed(records)) + '{"step": 2.0, "ti')
    loaded = load_records(metrics)
    assert [r["step"] for r in loaded] == [0.0, 1.0]
    assert rlship(["report", str(tmp_path)]) == 0
    assert all((tmp_path / name).stat().st_size > 0 for name in CHARTS)


def test_a_pass_fail_reward_is_banded_by_the_interval_of_its_mean() -> None:
    """p10-p90 of rewards that are 0 or 1 covers 0-1: the band is the mean's 95% interval."""
    key = "train/agg/all/reward"
    binary = [{f"{key}/mean": 0.25, f"{key}/p10": 0.0, f"{key}/p90": 1.0, f"{key}/min": 0.0,
               f"{key}/max": 1.0, "train/agg/all/count": 48.0}]  # fmt: skip
    low, high, label = spread(binary, key)
    half = 1.96 * (0.25 * 0.75 / 48) ** 0.5  # 0.1225
    assert label == "95% interval of the mean"
    assert (round(low[0], 6), round(high[0], 6)) == (round(0.25 - half, 6), round(0.25 + half, 6))
    graded = [{f"{key}/mean": 0.4, f"{key}/p10": 0.1, f"{key}/p90": 0.8, "train/agg/all/count": 48.0}]
    assert spread(graded, key) == ([0.1], [0.8], "p10-p90")


def test_report_without_records_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def refused() -> str:
        assert rlship(["report", str(tmp_path)]) == 2
        return capsys.readouterr().err

    assert "metrics.jsonl does not exist" in refused()
    (tmp_path / "metrics.jsonl").write_text("")
    assert "holds no records yet" in refused()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0.0\n{"step": 1.0}\n')
    assert "record 1 is not JSON" in refused()


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("[1, 2]", "record 2 is not a metrics record: expected a JSON object, got list"),
        ('{"time/ship": 1.0}', "record 2 is not a metrics record: it has no 'step'"),
        (
            '{"step": 1, "time/ship": "slow"}',
            "record 2 is not a metrics record: time/ship: 'slow' is not a number",
        ),
    ],
)
def test_report_names_a_record_of_the_wrong_shape(tmp_path: Path, line: str, problem: str) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n' + line + "\n")
    command = [*python_command(), "report", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [f"rlship report: {tmp_path / 'metrics.jsonl'}: {problem}"]


def test_report_says_a_cut_short_last_line_is_left_out(tmp_path: Path, capsys) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "time/ship": 1.0}\n{"step": 1, "ti')
    assert [r["step"] for r in load_records(metrics)] == [0]
    said = capsys.readouterr().err
    assert said == f"rlship report: {metrics}: the last line (record 2) is cut short; left out\n"
