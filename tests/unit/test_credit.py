"""Credit as prime-rl 559b447 has it, against oracles written from its source (not from
rlship's code): the rl weight of a token (`train_sink._prune_zero_advantages` on top of the
trainer's reading of an absent stream as 1.0 on the loss mask), GRPO's group baseline with
its linear length penalty (`algo/grpo.py`), and how rlship decides a group that mixes given
and computed credit, sizes groups per env and cancels them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from orchestrator.accounting import outcome_row
from orchestrator.group_cancel import CANCEL_FIELD, cancellation_entry
from orchestrator.groups import TRAINABLE, GroupBuffer, LengthPenalty, decide_group
from orchestrator.ingest import Ingest
from orchestrator.records import RecordRejected, RolloutRecord
from orchestrator.rollout_checks import call_problems
from orchestrator.rollout_log import RolloutLog
from orchestrator.settings import RunSettings, settings_to_env
from tasks.cohort import NUMERIC_COLUMNS, CohortBuilder
from tasks.manifest import ShipConfig, StepManifest
from tasks.stages.credit import GivenCredit, count_trainable, token_rl_weights
from tasks.stages.finalize import finalize_step
from tasks.stages.metrics import credit_counts
from tests.support.reference import prime_rl_weights


def record(rollout_id: str, reward: float = 0.0, **fields: object) -> RolloutRecord:
    defaults = {"group_id": "g", "task_id": "t", "env": "math", "policy_version": 5, "num_input_tokens": 3,
                "num_output_tokens": 4}  # fmt: skip
    return RolloutRecord(rollout_id=rollout_id, reward=reward, **(defaults | fields))


# -- prime-rl's rl weights --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_rl_weights_are_prime_rls(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 12))
    mask = rng.random(n) < 0.6
    advantages = np.where(rng.random(n) < 0.3, 0.0, rng.normal(size=n))
    given = np.where(rng.random(n) < 0.2, 0.0, rng.random(n)) if seed % 2 else None
    arrays = {"loss_mask": mask, "advantages": advantages} | (
        {"rl_weights": given} if given is not None else {}
    )
    expected = prime_rl_weights(mask.tolist(), advantages.tolist(), None if given is None else given.tolist())
    assert token_rl_weights(arrays).tolist() == expected
    assert count_trainable(arrays) == sum(
        m and w != 0.0 for m, w in zip(mask.tolist(), expected, strict=True)
    )
    # The group baseline's one advantage, broadcast, is the same rule.
    scalar = float(advantages[0]) if n else 0.0
    broadcast = prime_rl_weights(mask.tolist(), [scalar] * n, None)
    assert token_rl_weights({"loss_mask": mask}, scalar).tolist() == broadcast


def test_given_credit_summary_and_its_wire() -> None:
    arrays = {
        "loss_mask": np.array([False, True, True, True, False]),
        "advantages": np.array([9.0, 0.5, 0.0, -1.5, 9.0]),  # outside the mask: not observed
    }
    credit = GivenCredit.of(arrays)
    assert credit == GivenCredit(trainable_tokens=2, mean_advantage=(0.5 + 0.0 - 1.5) / 3)
    assert GivenCredit.from_wire(credit.to_wire().encode()) == credit
    assert GivenCredit.of({"loss_mask": np.array([True])}) is None, "no advantages: the group baseline's"
    assert GivenCredit.of({"loss_mask": np.zeros(2, bool), "advantages": np.ones(2)}) == GivenCredit(0, 0.0)
    assert GivenCredit.from_wire(None) is None and GivenCredit.from_wire(b"") is None
    for bad in (b"x 1", b"3", b"-1 0.5", b"2 nan", b"1 2 3"):
        with pytest.raises(ValueError, match="credit: "):
            GivenCredit.from_wire(bad)


# -- prime-rl's GRPO baseline, length-shaped ----------------------------------------------------


def prime_grpo(
    rewards: list[float], output: list[int], total: list[int], turns: list[int], weights
) -> list[float]:
    """prime-rl 559b447, algo/grpo.py `score_group`, in plain Python: rewards less
    mean(rewards) * (w_out * output / max(output, 1) + w_in * input / max(input, 1)
    + w_turns * turns / max(turns, 1)), input = total - output; minus their mean."""
    n = len(rewards)
    mean = sum(rewards) / n
    if weights is None:
        return [r - mean for r in rewards]
    w_out, w_in, w_turns = weights
    inputs = [t - o for t, o in zip(total, output, strict=True)]
    top_out, top_in, top_turns = max(max(output), 1), max(max(inputs), 1), max(max(turns), 1)
    shaped = [
        rewards[i]
        - mean * (w_out * output[i] / top_out + w_in * inputs[i] / top_in + w_turns * turns[i] / top_turns)
        for i in range(n)
    ]
    shaped_mean = sum(shaped) / n
    return [s - shaped_mean for s in shaped]


@pytest.mark.parametrize("weights", [None, (0.25, 0.1, 0.1), (1.0, 0.0, 0.0), (0.0, 0.5, 2.0)])
@pytest.mark.parametrize("seed", range(6))
def test_length_shaped_baseline_is_prime_rls(weights, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    rewards = [float(r) for r in rng.choice([0.0, 1.0, 0.5], size=n)]
    output = [int(x) for x in rng.integers(1, 300, size=n)]
    inputs = [int(x) for x in rng.integers(0, 200, size=n)]
    turns = [int(x) for x in rng.integers(1, 5, size=n)]
    records = [
        record(
            f"r{i}", rewards[i], num_input_tokens=inputs[i], num_output_tokens=output[i], num_turns=turns[i]
        )
        for i in range(n)
    ]
    penalty = (
        None
        if weights is None
        else LengthPenalty(
            num_output_tokens_weight=weights[0],
            num_input_tokens_weight=weights[1],
            num_turns_weight=weights[2],
        )
    )
    outcomes = decide_group(records, next_step=5, max_off_policy_steps=8, length_penalty=penalty)
    totals = [i + o for i, o in zip(inputs, output, strict=True)]
    expected = prime_grpo(rewards, output, totals, turns, weights)
    if len(set(rewards)) == 1 and weights is None:
        expected = [0.0] * n  # rlship's exact zero for equal rewards (prime-rl's float32 gives ~0)
    assert [o.advantage for o in outcomes] == pytest.approx(expected, abs=1e-12)


def test_length_penalty_defaults_are_prime_rls() -> None:
    assert LengthPenalty() == LengthPenalty(
        num_output_tokens_weight=0.25, num_input_tokens_weight=0.1, num_turns_weight=0.1
    )


# -- a group that mixes credit kinds ------------------------------------------------------------


def test_given_credit_keeps_its_own_and_the_baseline_is_of_the_rest() -> None:
    records = [record("b1", 1.0), record("b2", 0.0), record("given", 5.0), record("flat", 3.0)]
    given = {"given": GivenCredit(trainable_tokens=3, mean_advantage=0.25), "flat": GivenCredit(0, 0.0)}
    outcomes = {o.record.rollout_id: o for o in decide_group(records, 5, 8, given=given)}
    # baseline of b1 and b2 only (rewards 1 and 0: mean 0.5); the given rewards 5 and 3 take no part
    assert {k: o.advantage for k, o in outcomes.items()} == {
        "b1": 0.5,
        "b2": -0.5,
        "given": 0.25,
        "flat": 0.0,
    }
    assert {k: o.fate for k, o in outcomes.items()} == {
        "b1": TRAINABLE, "b2": TRAINABLE, "given": TRAINABLE, "flat": "zero_advantage",
    }  # fmt: skip
    assert {k: o.credit for k, o in outcomes.items()} == {
        "b1": "group_baseline", "b2": "group_baseline", "given": "given", "flat": "given",
    }  # fmt: skip
    # A given credit whose mean is 0 (advantages +1 and -1) still trains: its tokens say so.
    [balanced] = decide_group([record("pm", 1.0)], 5, 8, given={"pm": GivenCredit(2, 0.0)})
    assert balanced.fate == TRAINABLE
    numeric, _, _ = outcome_row(outcomes["given"], credit=given["given"])
    assert numeric["credit_tokens"] == 3.0 and numeric["advantage"] == 0.25


# -- groups per env, and cancelled ---------------------------------------------------------------


def test_group_size_per_env() -> None:
    buffer = GroupBuffer({"math": 2, "code": 3})
    assert buffer.add(record("m1", env="math")) is None
    assert [r.rollout_id for r in buffer.add(record("m2", env="math"))] == ["m1", "m2"]
    assert buffer.add(record("c1", env="code")) is None and buffer.add(record("c2", env="code")) is None
    assert len(buffer.add(record("c3", env="code"))) == 3
    with pytest.raises(RecordRejected, match=r"env: 'chat' has no size in the run's group_size") as caught:
        buffer.add(record("x", env="chat"))
    assert caught.value.reason == "unknown_env"


def test_a_cancelled_group_returns_its_arrived_rollouts_and_rejects_later_ones() -> None:
    buffer = GroupBuffer(3)
    buffer.add(record("a"))
    buffer.add(record("b"))
    assert [r.rollout_id for r in buffer.cancel("math", "g")] == ["a", "b"]
    with pytest.raises(RecordRejected, match="was cancelled by its producer") as caught:
        buffer.add(record("c"))
    assert caught.value.reason == "group_cancelled"
    assert buffer.cancel("math", "never-seen") == [] and len(buffer) == 0
    for rid in ("x", "y", "z"):
        buffer.add(record(rid, group_id="done"))
    assert buffer.cancel("math", "done") is None, "a complete group keeps its fates"


def test_the_producer_checks_groups_per_env() -> None:
    rollouts = [(record(f"m{i}", env="math", group_id="gm"), {}) for i in range(2)]
    rollouts += [(record(f"c{i}", env="code", group_id="gc"), {}) for i in range(2)]
    rollouts += [(record("x0", env="chat", group_id="gx"), {})]
    problems = call_problems(rollouts, {"math": 2, "code": 3}, None, partial_groups=False)
    assert problems == {
        "c0": "group_id: 'gc' has 2 of the run's group_size for env 'code' 3 rollouts in this call; write "
        "whole groups, or produce(..., partial_groups=True) to write the rest in later calls",
        "c1": "group_id: 'gc' has 2 of the run's group_size for env 'code' 3 rollouts in this call; write "
        "whole groups, or produce(..., partial_groups=True) to write the rest in later calls",
        "x0": "env: 'chat' has no size in the run's group_size {'math': 2, 'code': 3}",
    }
    assert call_problems(rollouts[:2], 2, None, partial_groups=False) == {}


def test_settings_read_sizes_per_env_and_the_length_penalty() -> None:
    run = RunSettings(group_size="math=8, code=4", length_penalty="num_turns_weight=0", envs="math,code")
    assert run.group_size == {"math": 8, "code": 4} and run.largest_group_size == 8
    assert run.length_penalty == LengthPenalty(num_turns_weight=0.0)
    again = settings_to_env(run)
    assert (
        RunSettings(
            group_size=again["RLSHIP_GROUP_SIZE"], length_penalty=again["RLSHIP_LENGTH_PENALTY"]
        ).model_dump()
        == RunSettings(group_size=run.group_size, length_penalty=run.length_penalty).model_dump()
    )
    assert RunSettings(group_size="4").group_size == 4 and RunSettings(length_penalty="linear").length_penalty
    assert RunSettings(length_penalty="none").length_penalty is None
    with pytest.raises(ValueError, match=r"group_size: \{'math': 8\} has no size for env\(s\) \['code'\]"):
        RunSettings(group_size="math=8", envs="math,code")
    with pytest.raises(ValueError, match="group_size: 'math' is not name=value"):
        RunSettings(group_size="math")
    with pytest.raises(ValueError, match="num_output_tokens_weight"):
        RunSettings(length_penalty="num_output_tokens_weight=-1")


# -- finalize and the record ------------------------------------------------------------------------


def _manifest(rows: list[tuple[str, float, dict[str, float]]]) -> StepManifest:
    builder = CohortBuilder()
    for rollout_id, advantage, extra in rows:
        numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {
            "advantage": advantage, "num_input_tokens": 1, "num_output_tokens": 3,
        } | extra  # fmt: skip
        builder.append(numeric, {"rollout_id": rollout_id})
    cohort = builder.build()
    return StepManifest("unit", 7, 6, 0.0, ShipConfig(ranks=1, seq_len=8, vocab_size=100), cohort, cohort)


def _arrays(**extra: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.array([1, 2, 3, 4]),
        "loss_mask": np.array([False, True, True, True]),
        "inference_logprobs": np.full(4, -0.5),
    } | extra


def test_finalize_counts_given_credit_by_its_facts_or_its_arrays() -> None:
    facts = {"payload_loss_tokens": 3.0, "payload_max_token_id": 4.0, "payload_bytes": 100.0}
    manifest = _manifest([
        ("by_facts", 0.0, facts | {"credit_tokens": 2.0}),  # mean 0 (e.g. +1 and -1): still 2 tokens
        ("read", 0.7, {"credit_tokens": 1.0}),
        ("read_zero", 0.0, {"credit_tokens": 0.0}),
        ("baseline", 0.5, facts),
        ("mismatch", 0.5, {}),
        ("lost", 0.5, {"credit_tokens": 2.0}),
    ])  # fmt: skip
    payloads = {
        "read": _arrays(advantages=np.array([0.0, 0.0, 0.7, 0.0])),
        "read_zero": _arrays(advantages=np.array([1.0, 0.0, 0.0, 0.0])),  # non-zero outside the mask only
        "mismatch": _arrays(advantages=np.ones(4)),
        "lost": _arrays(),
    }
    result = finalize_step(manifest, payloads)
    assert result.failures == {
        "mismatch": "advantages: in the arrays, but the rollout's stream entry has no credit summary",
        "lost": "advantages: the rollout's stream entry announced them, its arrays have none",
    }
    trainable = dict(
        zip(result.samples.labels["rollout_id"], result.samples.numeric["trainable_tokens"], strict=True)
    )
    assert trainable == {"by_facts": 2.0, "read": 1.0, "read_zero": 0.0, "baseline": 3.0}
    assert credit_counts(result.samples) == {"credit/given": 3.0, "credit/group_baseline": 1.0}


# -- the orchestrator's ingest: credit beside the record, cancellations in the stream -------------


def _ingest(**settings: object) -> Ingest:
    return Ingest(
        RunSettings(run_id="unit-credit", **settings),
        client=None,  # type: ignore[arg-type]  # taking records touches no Redis
        rollout_log=RolloutLog(None),
        stopping=asyncio.Event(),
        work=asyncio.Event(),
        next_step=lambda: 0,
        status=dict,
    )


def _raw(rollout_id: str, group_id: str, reward: float = 0.0, env: str = "math") -> bytes:
    return record(rollout_id, reward, group_id=group_id, env=env, policy_version=0).model_dump_json().encode()


def _balanced(ingest: Ingest) -> bool:
    """arrived = rejected + discarded + pending + in open groups (nothing cut here)."""
    counted = ingest.accounting
    return counted.arrived == counted.accounted + len(ingest.pending) + len(ingest.groups)


def test_ingest_takes_given_credit_and_cancellations() -> None:
    ingest = _ingest(group_size="math=2,code=3")
    assert ingest.take_record("1-0", _raw("a", "g1", 1.0), credit=b"2 0.25") == []
    assert ingest.take_record("2-0", _raw("b", "g1", 0.0)) == ["b"], "b: zero advantage, released"
    pending = ingest.pending.build()
    assert pending.labels["rollout_id"] == ["a"] and pending.numeric["credit_tokens"].tolist() == [2.0]
    assert pending.numeric["advantage"].tolist() == [0.25]

    # A group of three code rollouts, two arrived, then cancelled: both released at once.
    ingest.take_record("3-0", _raw("c0", "g2", 1.0, env="code"))
    ingest.take_record("4-0", _raw("c1", "g2", 0.0, env="code"), credit=b"1 -0.5")
    cancel = cancellation_entry("code", "g2", None)[CANCEL_FIELD.decode()].encode()
    assert ingest.cancel_group("5-0", cancel) == ["c0", "c1"]
    assert ingest.open_entries == {} and ingest.open_credit == {} and len(ingest.groups) == 0
    assert ingest.accounting.discarded["cancelled"] == 2 and ingest.accounting.cancelled_groups == 1
    assert ingest.outcomes["c0"] == ("discarded cancelled", "discarded/cancelled")
    window = ingest.window.build()
    assert window.numeric["cancelled"].tolist()[-2:] == [1.0, 1.0], "the `all` statistics see them cancelled"
    assert ingest.take_record("6-0", _raw("c2", "g2", env="code")) == ["c2"]
    assert ingest.accounting.rejected["group_cancelled"] == 1
    assert ingest.cancel_group("7-0", b"not json") == [], "a cancellation that does not parse is ignored"

    # A credit summary that does not parse is the producer's bug: rejected, named, released.
    assert ingest.take_record("8-0", _raw("d", "g3"), credit=b"many 1.0") == ["d"]
    assert ingest.accounting.rejected["invalid_credit"] == 1
    assert ingest.outcomes["d"][0].startswith("rejected invalid_credit credit: 'many 1.0'")
    assert _balanced(ingest)


def test_a_cancellation_read_again_after_a_restart_releases_nothing_but_still_rejects() -> None:
    ingest = _ingest(group_size=2)
    ingest.take_record("1-0", _raw("a", "g"))
    ingest.cancel_group("2-0", cancellation_entry("math", "g", None)["cancel"].encode())
    ingest.stream_cursor = "2-0"  # as the read loop leaves it
    restarted = _ingest(group_size=2)
    restarted.resume(ingest.checkpoint())
    assert restarted.take_record("1-0", _raw("a", "g")) == [], "not open at the checkpoint: not taken again"
    assert restarted.cancel_group("2-0", cancellation_entry("math", "g", None)["cancel"].encode()) == []
    assert restarted.accounting.cancelled_groups == 1 and restarted.accounting.discarded["cancelled"] == 1
    assert restarted.take_record("3-0", _raw("late", "g")) == ["late"]
    assert restarted.accounting.rejected["group_cancelled"] == 1
