"""Group advantages, fates, the group buffer and the orchestrator's accounting, against values
worked out by hand."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from orchestrator.accounting import Accounting, outcome_row
from orchestrator.groups import TRAINABLE, GroupBuffer, Outcome, RecentSet, decide_group, group_advantages
from orchestrator.records import InvalidRecord, RecordRejected, RolloutRecord, parse_record


def record(rollout_id: str, reward: float = 0.0, **fields) -> RolloutRecord:
    defaults = {"group_id": "g", "task_id": "t", "env": "math", "policy_version": 5, "num_input_tokens": 3,
                "num_output_tokens": 4}  # fmt: skip
    return RolloutRecord(rollout_id=rollout_id, reward=reward, **(defaults | fields))


def test_advantages_by_hand() -> None:
    # rewards 1, 0, 0, 3: mean 1 -> 0, -1, -1, 2; population std sqrt((0 + 1 + 1 + 4) / 4) = sqrt(1.5)
    rewards = np.array([1.0, 0.0, 0.0, 3.0])
    assert group_advantages(rewards).tolist() == [0.0, -1.0, -1.0, 2.0]
    scale = math.sqrt(1.5) + 1e-8
    assert group_advantages(rewards, normalize=True).tolist() == pytest.approx(
        [0.0, -1 / scale, -1 / scale, 2 / scale], rel=1e-12
    )
    assert group_advantages(np.array([])).tolist() == []
    assert group_advantages(np.array([0.3, 0.3]), normalize=True).tolist() == [0.0, 0.0]
    assert group_advantages(np.array([2.0])).tolist() == [0.0]


def test_fates_in_order_of_precedence() -> None:
    records = [
        record("err", 9.0, error="timeout", cancelled=True, policy_version=0),
        record("can", 9.0, cancelled=True, policy_version=0),
        record("old", 3.0, policy_version=1),  # next_step 4 - 1 = 3 > 2: stale
        record("edge", 0.0, policy_version=2),  # 4 - 2 = 2, not more than 2: fresh
        record("mean", 2.0),  # the mean of the scored rewards 3, 0, 2, 3: zero advantage
        record("mute", 3.0, num_output_tokens=0),  # advantage 1 but no output token
    ]
    outcomes = {o.record.rollout_id: o for o in decide_group(records, next_step=4, max_off_policy_steps=2)}
    assert {k: o.fate for k, o in outcomes.items()} == {
        "err": "error", "can": "cancelled", "old": "stale", "edge": TRAINABLE, "mean": "zero_advantage",
        "mute": "zero_advantage",
    }  # fmt: skip
    # baseline over the scored rollouts only (errored and cancelled, rewarded 9, left out): 2
    assert {k: o.advantage for k, o in outcomes.items()} == {
        "err": 0.0, "can": 0.0, "old": 1.0, "edge": -2.0, "mean": 0.0, "mute": 1.0,
    }  # fmt: skip
    assert all(type(o.advantage) is float for o in outcomes.values())
    assert [o.record.rollout_id for o in decide_group(records, 4, 2)] == [r.rollout_id for r in records]


def test_normalized_fates_and_a_group_of_only_errors() -> None:
    outcomes = decide_group(
        [record("a", 1.0), record("b", 0.0)], next_step=5, max_off_policy_steps=0, normalize=True
    )
    assert [o.advantage for o in outcomes] == pytest.approx([0.5 / (0.5 + 1e-8), -0.5 / (0.5 + 1e-8)])
    assert [o.fate for o in outcomes] == [TRAINABLE, TRAINABLE]
    errors = decide_group([record("x", 1.0, error="e"), record("y", 0.0, error="e")], 5, 0)
    assert [(o.advantage, o.fate) for o in errors] == [(0.0, "error"), (0.0, "error")]


def test_recent_set_forgets_the_oldest_past_capacity() -> None:
    recent = RecentSet(2)
    for item in ("a", "b", "c"):
        recent.add(item)
    assert "a" not in recent and "b" in recent and "c" in recent
    recent.add("d")
    assert "b" not in recent and "c" in recent and "d" in recent


def test_group_buffer_completes_rejects_duplicates_and_overflow() -> None:
    buffer = GroupBuffer(group_size=2)
    first = record("r1", group_id="g1")
    assert buffer.add(first) is None and len(buffer) == 1
    assert buffer.add(record("r2", group_id="g1", env="code")) is None, "same group id, another env"
    assert len(buffer) == 2
    with pytest.raises(RecordRejected, match=r"rollout_id: 'r1' already received") as duplicate:
        buffer.add(record("r1", group_id="g9"))
    assert duplicate.value.reason == "duplicate_rollout"
    second = record("r3", group_id="g1")
    assert buffer.add(second) == [first, second] and len(buffer) == 1
    with pytest.raises(
        RecordRejected, match=r"group_id: 'g1' of env 'math' already has 2 rollouts"
    ) as overflow:
        buffer.add(record("r4", group_id="g1"))
    assert overflow.value.reason == "group_overflow"
    assert len(buffer) == 1


def test_group_buffer_memory_is_bounded() -> None:
    buffer = GroupBuffer(group_size=1, memory=1)
    buffer.add(record("r1", group_id="g1"))
    buffer.add(record("r2", group_id="g2"))
    assert buffer.add(record("r1", group_id="g3")) == [record("r1", group_id="g3")], "r1 forgotten"
    assert buffer.add(record("r5", group_id="g1")) is not None, "g1 forgotten"


def test_outcome_row_by_hand() -> None:
    r = record("r", 0.5, num_turns=3, temperature=0.7, is_truncated=True, stop_condition="length",
               metrics={"len": 2.0}, task_id="t7", env="code", group_id="g2", policy_version=9)  # fmt: skip
    numeric, labels, custom = outcome_row(Outcome(r, -0.25, TRAINABLE))
    assert numeric == {
        "reward": 0.5, "advantage": -0.25, "num_input_tokens": 3, "num_output_tokens": 4, "num_turns": 3,
        "temperature": 0.7, "policy_version": 9, "is_truncated": 1.0, "is_trainable": 1.0, "has_error": 0.0,
        "cancelled": 0.0,
    }  # fmt: skip
    assert labels == {"rollout_id": "r", "env": "code", "group_id": "g2", "task_id": "t7", "error": "",
                      "stop_condition": "length", "agent": "", "episode_id": "", "trace_id": ""}  # fmt: skip
    assert custom == {"len": 2.0}
    trace = {
        "id": "t1",
        "num_input_tokens": 9,
        "num_output_tokens": 8,
        "num_total_tokens": 13,
        "num_branches": 2,
    }
    numeric, labels, _ = outcome_row(Outcome(record("b", episode_id="e1", trace=trace), 0.0, TRAINABLE))
    assert (labels["episode_id"], labels["trace_id"]) == ("e1", "t1"), "a branch names its episode and trace"
    assert {name: numeric[name] for name in numeric if name.startswith("trace/")} == {
        "trace/num_input_tokens": 9.0, "trace/num_output_tokens": 8.0, "trace/num_total_tokens": 13.0,
        "trace/num_branches": 2.0,
    }  # fmt: skip


def test_a_trace_is_of_an_episode() -> None:
    trace = {
        "id": "t1",
        "num_input_tokens": 1,
        "num_output_tokens": 1,
        "num_total_tokens": 2,
        "num_branches": 1,
    }
    with pytest.raises(InvalidRecord, match="trace: given without episode_id"):
        record("b", trace=trace)
    with pytest.raises(
        InvalidRecord, match=r"trace.num_total_tokens: Input should be greater than or equal to 0"
    ):
        record("b", episode_id="e", trace=trace | {"num_total_tokens": -1})
    with pytest.raises(RecordRejected, match=r"trace.num_branches: Input should be a valid integer"):
        parse_record(
            record("b", episode_id="e", trace=trace)
            .model_dump_json()
            .replace('"num_branches":1', '"num_branches":"1"')
        )
    assert (
        parse_record(record("b", episode_id="e", trace=trace).model_dump_json()).trace.num_total_tokens == 2
    )
    errored = record("e", error="timeout", cancelled=True)
    numeric, labels, _ = outcome_row(Outcome(errored, 0.0, "error"))
    assert (numeric["is_trainable"], numeric["has_error"], numeric["cancelled"], numeric["is_truncated"]) == (
        0.0, 1.0, 1.0, 0.0,
    )  # fmt: skip
    assert labels["error"] == "timeout" and labels["stop_condition"] == ""


def test_accounting_by_hand() -> None:
    accounting = Accounting(arrived=20, cut=6)
    accounting.rejected.update({"duplicate_rollout": 2, "group_overflow": 1})
    accounting.discard("zero_advantage", 4)
    accounting.discard("stale")
    accounting.discard("stale", 2)
    accounting.empty_cut(2, {"input_ids": 2})  # two of the six cut came back from a step the workers emptied
    assert accounting.accounted == 3 + 9 + 4
    snapshot = accounting.snapshot(pending=3, in_open_groups=1)
    assert snapshot == {
        "off_policy/stale_dropped": 3.0, "accounting/arrived": 20.0, "accounting/cut": 4.0,
        "accounting/pending": 3.0, "accounting/in_open_groups": 1.0, "accounting/rejected": 3.0,
        "accounting/discarded": 9.0, "accounting/cancelled_groups": 0.0,
        "ingest/rejected/duplicate_rollout": 2.0, "ingest/rejected/group_overflow": 1.0,
        "accounting/discarded/zero_advantage": 4.0,
        "accounting/discarded/stale": 3.0, "accounting/discarded/empty_step": 2.0,
        "empty_step/total": 1.0, "empty_step/consecutive": 1.0, "empty_step/dropped/input_ids": 2.0,
    }  # fmt: skip
    assert all(type(v) is float for v in snapshot.values())
    assert accounting.snapshot(0, 0)["off_policy/stale_dropped"] == 0.0, "a new window for stale drops"
    accounting.discard("stale")
    again = Accounting.from_wire(accounting.to_wire())
    assert again == accounting
    assert accounting.to_wire() == {
        "arrived": 20, "cut": 4, "rejected": {"duplicate_rollout": 2, "group_overflow": 1},
        "discarded": {"zero_advantage": 4, "stale": 4, "empty_step": 2}, "stale_in_window": 1,
        "empty_steps": 1, "empty_in_a_row": 1, "empty_dropped": {"input_ids": 2}, "cancelled_groups": 0,
    }  # fmt: skip
    assert isinstance(again.rejected, Counter) and isinstance(again.discarded, Counter)
