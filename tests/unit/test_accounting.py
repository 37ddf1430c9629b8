"""The accounting balance, checked both ways: the finalizer flags a record whose arrived
count is above or below the sum of its terms, and the plain-Python reference recomputes
the balance from its own counts of the rollout log (pending included)."""

from __future__ import annotations

import logging

import pytest

from tasks.stages.publish import build_record
from tests.support.reference import reference_records

# rejected 1 + discarded 2 + pending 3 + in open groups 4 + shipped 5 + dropped by workers 1
BALANCED_ARRIVED = 16.0


def finalizer_record(arrived: float) -> dict[str, float]:
    metrics = {
        "accounting/arrived": arrived,
        "accounting/rejected": 1.0,
        "accounting/discarded": 2.0,
        "accounting/pending": 3.0,
        "accounting/in_open_groups": 4.0,
    }
    return build_record(
        7, metrics, {}, 0.0, 0.0, {"rollouts": 5.0, "dropped_by_workers": 1.0}, names="rlship-1"
    )


@pytest.mark.parametrize("arrived", [BALANCED_ARRIVED + 1, BALANCED_ARRIVED - 1])
def test_the_finalizer_flags_a_record_unbalanced_either_way(arrived, caplog):
    with caplog.at_level(logging.ERROR, logger="rlship.publish"):
        record = finalizer_record(arrived)
    assert record["accounting/balanced"] == 0.0
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"step 7: the record's accounting does not add up: accounting/arrived {arrived:g} != " in message


def test_the_finalizer_passes_a_balanced_record(caplog):
    with caplog.at_level(logging.ERROR, logger="rlship.publish"):
        assert finalizer_record(BALANCED_ARRIVED)["accounting/balanced"] == 1.0
    assert caplog.records == []


def line(rollout_id: str, group: str, reward: float, advantage: float, **fate) -> dict:
    return {
        "rollout_id": rollout_id, "group_id": group, "task_id": f"t-{group}", "env": "math",
        "policy_version": 0, "reward": reward, "advantage": advantage, "num_input_tokens": 2,
        "num_output_tokens": 3, "num_turns": 1, "temperature": 1.0, "is_truncated": False,
        "error": None, "cancelled": False, "stop_condition": None, "metrics": {},
        "is_trainable": advantage != 0.0, "step": 0, **fate,
    }  # fmt: skip


# Cut 0 takes one of g1's two trainable rollouts and leaves the other pending; g2 has zero
# advantage and is discarded; cut 1 takes the pending one. Besides these four: one record
# rejected and one rollout in a group that never completes, as the records report.
LOG = [
    line("a", "g1", 1.0, 0.5, fate="shipped", shipped_step=0),
    line("b", "g1", 0.0, -0.5, fate="shipped", shipped_step=1),
    line("c", "g2", 1.0, 0.0, fate="discarded", reason="zero_advantage", discarded_step=0),
    line("d", "g2", 1.0, 0.0, fate="discarded", reason="zero_advantage", discarded_step=0),
]


def reported(step: int, arrived: float) -> dict[str, float]:
    return {
        "step": step,
        "accounting/arrived": arrived,
        "accounting/rejected": 1,
        "accounting/in_open_groups": 1,
    }


def test_the_reference_counts_pending_and_checks_the_balance_itself():
    expected = reference_records(LOG, [reported(0, 6), reported(1, 6)], first_step=0, names="rlship-1")
    assert expected[0]["accounting/pending"] == 1 and expected[1]["accounting/pending"] == 0
    assert expected[0]["accounting/discarded"] == 2 and expected[1]["accounting/shipped"] == 2
    assert expected[0]["accounting/balanced"] == expected[1]["accounting/balanced"] == 1.0


@pytest.mark.parametrize("arrived", [5, 7])
def test_the_reference_flags_a_record_unbalanced_either_way(arrived):
    expected = reference_records(LOG, [reported(0, arrived)], first_step=0, names="rlship-1")
    assert expected[0]["accounting/balanced"] == 0.0


def test_the_reference_flags_a_record_that_hides_its_open_groups():
    expected = reference_records(
        LOG, [{**reported(0, 6), "accounting/in_open_groups": 0}], first_step=0, names="rlship-1"
    )
    assert expected[0]["accounting/balanced"] == 0.0
