"""Step numbering: the numbering functions against prime-rl's rules written out by hand, and
how a run's settings resolve `first_step` and `start_step`.

The oracle is prime-rl's orchestrator and trainer as they behave, not rlship's formulas:
its steps count from 1; its trainer announces version 0 at start-up and version s after
training step s; its orchestrator ships step s once the version is at least
s - 1 - max_async_level; a rollout generated with version v and trained at step s is
s - 1 - v steps off-policy. Every row below was worked out by hand from those sentences.
"""

from __future__ import annotations

import argparse
import os

import pytest

from orchestrator.groups import TRAINABLE, decide_group
from orchestrator.settings import RunSettings, settings_to_env
from orchestrator.settings_resolution import add_settings_arguments, settings_from_args
from tests.support.factories import group
from tests.support.shiprun import delivered, ship, ship_settings
from transport.keys import RunKeys
from transport.numbering import required_version, staleness, step_reaching, version_after

# (prime-rl step s, policy version v the trainers announced, max_async_level) ->
# (may step s ship?, steps off-policy of a rollout made with version v, trained at s)
PRIME_RL_TABLE = [
    ((1, 0, 0), (True, 0)),  # the first step needs version 0, which exists at start-up
    ((1, 0, 1), (True, 0)),
    ((2, 0, 0), (False, 1)),  # fully synchronous: step 2 waits for step 1 to be trained
    ((2, 1, 0), (True, 0)),
    ((2, 0, 1), (True, 1)),  # one step of asynchrony: step 2 may go with version 0
    ((3, 0, 1), (False, 2)),
    ((3, 1, 1), (True, 1)),
    ((3, 2, 1), (True, 0)),
    ((5, 1, 2), (False, 3)),
    ((5, 2, 2), (True, 2)),
    ((10, 7, 1), (False, 2)),
    ((10, 8, 1), (True, 1)),
    ((10, 9, 1), (True, 0)),
]


@pytest.mark.parametrize(("row", "expected"), PRIME_RL_TABLE)
def test_prime_rl_numbering_gates_and_ages_as_prime_rl_does(row, expected):
    step, version, max_async_level = row
    ships, off_policy = expected
    assert (version >= required_version(step, 1, max_async_level)) is ships
    assert staleness(step, version, 1) == off_policy


@pytest.mark.parametrize(("row", "expected"), PRIME_RL_TABLE)
def test_numbering_from_zero_is_the_same_run_shifted_by_one(row, expected):
    """rlship's step n (first_step 0) is prime-rl's step n + 1: the same gate, the same age."""
    step, version, max_async_level = row
    ships, off_policy = expected
    assert (version >= required_version(step - 1, 0, max_async_level)) is ships
    assert staleness(step - 1, version, 0) == off_policy
    assert staleness(step - 1, version, 0) == (step - 1) - version, "what rlship computed before"


def test_the_version_after_a_step_is_the_number_of_steps_trained():
    assert [version_after(s, 1) for s in (1, 2, 3)] == [1, 2, 3]
    assert [version_after(s, 0) for s in (0, 1, 2)] == [1, 2, 3]
    # The step that, once trained, brings the version to 1, 2, 3: prime-rl's steps 1, 2, 3.
    assert [step_reaching(v, 1) for v in (1, 2, 3)] == [1, 2, 3]
    assert [step_reaching(v, 0) for v in (1, 2, 3)] == [0, 1, 2]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("RLSHIP_"):
            monkeypatch.delenv(name)


def test_external_trainers_count_from_one_and_the_builtin_one_from_zero():
    external, builtin = RunSettings(trainers="external"), RunSettings(trainers="builtin")
    assert (external.first_step, external.start_step) == (1, 1)
    assert (builtin.first_step, builtin.start_step) == (0, 0)
    assert external.step_numbers == range(1, 6) and builtin.step_numbers == range(0, 5)


def test_set_numbering_wins_and_a_resumed_trainer_starts_later():
    assert RunSettings(trainers="external", first_step=0).first_step == 0
    resumed = RunSettings(trainers="external", start_step=5, steps=3)
    assert (resumed.first_step, resumed.start_step, list(resumed.step_numbers)) == (1, 5, [5, 6, 7])


def test_a_start_before_the_first_step_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"start_step: 0 must be >= first_step \(1\)"):
        RunSettings(trainers="external", start_step=0)
    with pytest.raises(ValueError, match="first_step"):
        RunSettings(first_step=2)


def test_the_flags_resolve_and_an_invalid_start_names_its_flag(monkeypatch: pytest.MonkeyPatch):
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    settings = settings_from_args(parser.parse_args(["--trainers", "external", "--start-step", "7"]))
    assert (settings.first_step, settings.start_step) == (1, 7)
    monkeypatch.setenv("RLSHIP_FIRST_STEP", "1")
    with pytest.raises(SystemExit) as stopped:
        settings_from_args(parser.parse_args(["--start-step", "0"]))
    assert str(stopped.value.code) == (
        "rlship: invalid setting: start_step: 0 must be >= first_step (1): "
        "the run cannot start before its first step (from --start-step)"
    )


def test_a_changed_copy_derives_the_numbering_again():
    """`model_copy(update=...)` would keep the builtin trainer's 0 for external trainers."""
    builtin = RunSettings()
    external = builtin.with_changes(trainers="external")
    assert (external.first_step, external.start_step) == (1, 1)
    assert builtin.with_changes(first_step=1).start_step == 1
    assert RunSettings(start_step=3).with_changes(trainers="external").start_step == 3
    with pytest.raises(ValueError, match="start_step"):
        builtin.with_changes(trainers="external", start_step=0)


def test_children_derive_the_numbering_the_parent_derived():
    """`rlship run`'s children get derived numbering unset, so a child derives it again (and a
    copy of its settings with other trainers still derives it) instead of inheriting a 0."""

    env = settings_to_env(RunSettings(trainers="external"))
    assert (env["RLSHIP_FIRST_STEP"], env["RLSHIP_START_STEP"]) == ("", "")
    assert settings_to_env(RunSettings(start_step=4))["RLSHIP_START_STEP"] == "4"


@pytest.mark.parametrize(
    ("first_step", "next_step", "version", "fate"),
    [
        # prime-rl's step 5 (first_step 1) trains version 1 three steps off-policy: stale at 2
        (1, 5, 1, "stale"),
        (1, 5, 2, TRAINABLE),  # two steps off-policy: kept
        (0, 4, 1, "stale"),  # the same step numbered from 0
        (0, 4, 2, TRAINABLE),
    ],
)
def test_a_group_goes_stale_by_prime_rl_staleness(first_step, next_step, version, fate):
    rollouts = [r for r, _ in group("g", [1.0, 0.0], policy_version=version)]
    outcomes = decide_group(rollouts, next_step, max_off_policy_steps=2, first_step=first_step)
    assert {o.fate for o in outcomes} == {fate}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("first_step", "start_step", "steps", "version"),
    [(1, 1, [1, 2], 2), (0, 3, [3, 4], 5)],
    ids=["prime-rl-numbering", "resumed-at-3"],
)
def test_rlship_trainers_receive_and_acknowledge_the_runs_numbers(
    first_step, start_step, steps, version, client, redis_url, run_id, workers, tmp_path
):
    """End to end with `rlship trainer` ranks: they expect the run's first step, the records
    carry its numbers, and the policy version after the last step is the number of steps
    trained (a run resumed at step 3 of a 0-numbered run starts at version 3; with
    max_async_level 0 its gate would hold forever otherwise)."""
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=2, first_step=first_step, start_step=start_step,
        max_async_level=0,
    )  # fmt: skip
    result = ship(settings)
    assert [int(r["step"]) for r in result.records] == steps
    checksums, counts = delivered(client, run_id, settings.ranks)
    for rank in range(settings.ranks):
        assert sorted(checksums[rank]) == steps and set(counts[rank].values()) == {1}
    assert int(client.get(RunKeys(run_id).policy_version)) == version
