"""The per-step samples file and the release stage's heap trim, without a broker."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import pytest

from tasks.cohort import NUMERIC_COLUMNS, CohortBuilder
from tasks.stages.release import trim_process_memory
from tasks.stages.samples import choose_samples, sample_lines, write_samples


def test_choose_samples() -> None:
    assert choose_samples(0, 3, step=1) == [] and choose_samples(5, 0, step=1) == []
    assert choose_samples(5, -1, step=1) == []
    assert choose_samples(3, 10, step=4) == [0, 1, 2], "never more than were shipped"
    chosen = choose_samples(1000, 5, step=7)
    assert len(chosen) == 5 and len(set(chosen)) == 5 and chosen == sorted(chosen)
    assert all(0 <= i < 1000 for i in chosen)
    assert chosen == choose_samples(1000, 5, step=7), "the same for every run of the step"
    assert chosen != choose_samples(1000, 5, step=8)


def test_sample_lines_and_the_file(tmp_path: Path) -> None:
    builder = CohortBuilder()
    for rollout_id, reward, advantage in (("a", 1.0, 0.5), ("b", 0.0, -0.5)):
        numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {"reward": reward, "advantage": advantage}
        builder.append(numeric, {"rollout_id": rollout_id, "env": "math", "task_id": f"t-{rollout_id}"})
    arrays = {
        "a": {"input_ids": np.array([5, 6], dtype=np.int32), "loss_mask": np.array([False, True])},
        "b": {"input_ids": np.array([7], dtype=np.int64), "loss_mask": np.array([True])},
    }
    lines = sample_lines(3, builder.build(), [1, 0], arrays)
    expected = [
        {"step": 3, "rollout_id": "b", "env": "math", "task_id": "t-b", "reward": 0.0, "advantage": -0.5,
         "input_ids": [7], "loss_mask": [True]},
        {"step": 3, "rollout_id": "a", "env": "math", "task_id": "t-a", "reward": 1.0, "advantage": 0.5,
         "input_ids": [5, 6], "loss_mask": [False, True]},
    ]  # fmt: skip
    assert lines == expected
    path = write_samples(tmp_path, 3, lines)
    assert path == tmp_path / "samples" / "step_3.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == expected
    assert path.read_text().endswith("\n")
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_3.jsonl"], "no temporary file left"
    write_samples(tmp_path, 3, lines[:1])
    assert len(path.read_text().splitlines()) == 1, "a rewrite replaces the file"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_runs_where_glibc_has_malloc_trim() -> None:
    assert trim_process_memory() is True


def test_trim_calls_malloc_trim_with_zero_padding_and_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # glibc's malloc_trim(pad): pad 0 keeps nothing at the top of the heap (man 3 malloc_trim).
    calls: list[tuple] = []
    monkeypatch.setattr("tasks.stages.release._malloc_trim", lambda: lambda *args: calls.append(args))
    assert trim_process_memory() is True
    assert calls == [(0,)]


def test_trim_reports_false_where_there_is_no_malloc_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tasks.stages.release._malloc_trim", lambda: None)
    assert trim_process_memory() is False
