"""A resumed run's settings (orchestrator.resume): the run's own, with what may change given
again. Pure: the stored form is the JSON the orchestrator writes; the oracles are literals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.resume import ResumeRefused, check_steps_left, resumed, stored_form
from orchestrator.settings import RunSettings


def started(tmp_path: Path, **values) -> str:
    """What the run's first start stored."""
    return stored_form(RunSettings(run_id="r", output_dir=tmp_path / "runs" / "r", **values))


def test_the_stored_form_keeps_what_was_given_not_the_password_nor_derived_values(tmp_path: Path) -> None:
    stored = json.loads(started(tmp_path, steps=10, redis_url="redis://:hunter2@h:6379/0"))
    assert stored["steps"] == 10 and stored["output_dir"] == str(tmp_path / "runs" / "r")
    assert "redis_url" not in stored and "hunter2" not in json.dumps(stored)
    assert {"first_step", "cpu_queue", "broadcast_dir"}.isdisjoint(stored), "derived: derived again"


def test_nothing_given_again_resumes_with_the_runs_settings(tmp_path: Path) -> None:
    stored = started(tmp_path, steps=10, ranks=3, batch_size=16)
    settings, changes = resumed(stored, RunSettings(run_id="r", redis_url="redis://h:1/0"), given=set())
    assert (settings.steps, settings.ranks, settings.batch_size, changes) == (10, 3, 16, {})
    assert settings.output_dir == tmp_path / "runs" / "r" and settings.redis_url == "redis://h:1/0"


def test_what_may_change_changes_and_is_said(tmp_path: Path) -> None:
    stored = started(tmp_path, steps=10, ranks=3)
    given = RunSettings(run_id="r", steps=20, ranks=3, zmq_port=7000, output_dir=tmp_path / "elsewhere")
    settings, changes = resumed(stored, given, given={"steps", "ranks", "zmq_port"})
    assert (settings.steps, settings.ranks, settings.zmq_port) == (20, 3, 7000)
    assert settings.output_dir == tmp_path / "runs" / "r", "not given: the run's"
    assert changes == {"steps": "10 -> 20", "zmq_port": "5555 -> 7000"}


def test_what_may_not_change_stops_the_resume_naming_each(tmp_path: Path) -> None:
    stored = started(tmp_path, ranks=2, seq_len=1024)
    given = RunSettings(run_id="r", ranks=4, seq_len=512, steps=9)
    with pytest.raises(ResumeRefused) as refused:
        resumed(stored, given, given={"ranks", "seq_len", "steps"})
    assert str(refused.value) == (
        "run r was started with other settings (ranks: 2 in the run, 4 given; seq_len: 1024 in the run, "
        "512 given): a resumed run keeps them; leave them out to resume, or start a new run"
    )


def test_a_derived_value_of_the_run_counts_and_a_relative_path_is_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored = started(tmp_path)  # builtin trainers: first_step derived as 0
    with pytest.raises(ResumeRefused, match="first_step: 0 in the run, 1 given"):
        resumed(stored, RunSettings(run_id="r", first_step=1), given={"first_step"})
    monkeypatch.chdir(tmp_path)
    same_place = RunSettings(run_id="r", output_dir=Path("runs/r"))
    assert resumed(stored, same_place, given={"output_dir"})[1] == {}


@pytest.mark.parametrize(("steps", "refused"), [(6, True), (7, True), (8, False)])
def test_a_resume_must_have_a_step_left_to_ship(steps: int, refused: bool) -> None:
    settings = RunSettings(run_id="r", steps=steps)
    if not refused:
        check_steps_left(settings, shipped=7)
        return
    with pytest.raises(ResumeRefused, match=f"run r has shipped 7 steps; steps={steps} would end it at or"):
        check_steps_left(settings, shipped=7)
