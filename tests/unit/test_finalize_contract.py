"""Finalize's checks and annotations and prune's rules, each against a hand-written case."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.cohort import NUMERIC_COLUMNS, CohortBuilder
from tasks.manifest import ShipConfig, StepManifest
from tasks.stages.credit import token_rl_weights
from tasks.stages.finalize import check_rollout_arrays, finalize_step
from tasks.stages.prune import (
    count_trainable_tokens,
    drop_field,
    drop_reason,
    has_training_signal,
    prune_samples,
    worker_drops,
)


def arrays(n: int = 4, **replace: np.ndarray) -> dict[str, np.ndarray]:
    base = {
        "input_ids": np.arange(1, n + 1, dtype=np.int32),
        "loss_mask": np.arange(n) >= 1,
        "inference_logprobs": np.full(n, -0.5, dtype=np.float32),
        "ref_logprobs": np.full(n, -0.25, dtype=np.float32),
        "routed_experts": np.zeros((n, 2), dtype=np.int16),
    }
    return base | replace


def check(
    payload: dict[str, np.ndarray], expected: int = 4, seq_len: int = 8, vocab: int = 100
) -> str | None:
    return check_rollout_arrays(payload, expected, seq_len, vocab)


def test_valid_arrays_pass_at_every_bound() -> None:
    assert check(arrays()) is None
    assert check(arrays(8), expected=8, seq_len=8) is None, "exactly seq_len tokens fit"
    assert check(arrays(input_ids=np.array([0, 99, 5, 1], dtype=np.uint16))) is None, "ids 0 and vocab - 1"
    assert check(arrays(0), expected=0) is None, "an empty rollout has no id to range-check"
    optional = {k: v for k, v in arrays().items() if k not in ("ref_logprobs", "routed_experts")}
    assert check(optional) is None


@pytest.mark.parametrize("name", ["input_ids", "loss_mask", "inference_logprobs"])
def test_a_missing_or_two_dimensional_required_array_is_named(name: str) -> None:
    assert check({k: v for k, v in arrays().items() if k != name}) == f"{name}: missing from the payload"
    assert check(arrays(**{name: np.zeros((4, 1))})) == f"{name}: expected one dimension, got shape (4, 1)"


def test_lengths() -> None:
    assert check(arrays(), expected=5) == "input_ids: length 4, the record says 5 tokens"
    assert check(arrays(9), expected=9) == "input_ids: length 9 exceeds seq_len 8"
    for name in ("loss_mask", "inference_logprobs", "ref_logprobs"):
        shorter = arrays(**{name: arrays(3)[name]})
        assert check(shorter) == f"{name}: length 3, expected 4 (len(input_ids))"
    assert (
        check(arrays(routed_experts=np.zeros((5, 2))))
        == "routed_experts: length 5, expected 4 (len(input_ids))"
    )


def test_token_ids_and_dtypes() -> None:
    assert check(arrays(input_ids=np.array([1.0, 2, 3, 4]))) == "input_ids: dtype float64, expected integers"
    assert check(arrays(input_ids=np.array([1, 100, 3, 4]))) == "input_ids: token id 100 outside [0, 100)"
    assert check(arrays(input_ids=np.array([0, 100, 3, 4]))) == "input_ids: token id 100 outside [0, 100)"
    assert check(arrays(input_ids=np.array([0, -1, 3, 4]))) == "input_ids: token id -1 outside [0, 100)"
    assert check(arrays(input_ids=np.array([-2, 500, 3, 4]))) == "input_ids: token id -2 outside [0, 100)"
    assert check(arrays(loss_mask=np.array([0, 1, 1, 1]))) == "loss_mask: dtype int64, expected bool"


def test_the_first_non_finite_logprob_is_named() -> None:
    logprobs = np.array([-1.0, np.inf, np.nan, -np.inf])
    assert check(arrays(inference_logprobs=logprobs)) == "inference_logprobs: non-finite value inf"
    assert (
        check(arrays(ref_logprobs=np.array([-1.0, -2.0, np.nan, np.inf])))
        == "ref_logprobs: non-finite value nan"
    )


def _manifest() -> StepManifest:
    builder = CohortBuilder()
    rows = [  # (rollout_id, advantage, policy_version, output tokens)
        ("gone", 1.0, 0, 3), ("broken", 1.0, 0, 3), ("good", 0.5, 2, 3), ("flat", 0.0, 5, 3),
        ("short", 1.0, 0, 1),
    ]  # fmt: skip
    for rollout_id, advantage, version, output in rows:
        numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {
            "advantage": advantage, "policy_version": version, "num_input_tokens": 1,
            "num_output_tokens": output,
        }  # fmt: skip
        builder.append(numeric, {"rollout_id": rollout_id})
    cohort = builder.build()
    return StepManifest("unit", 7, 6, 0.0, ShipConfig(ranks=1, seq_len=8, vocab_size=100), cohort, cohort)


def test_finalize_annotates_the_good_and_names_the_rest() -> None:
    payloads = {"broken": OSError("connection reset"), "good": arrays(), "flat": arrays(), "short": arrays()}
    result = finalize_step(_manifest(), payloads)
    assert result.failures == {
        "gone": "payload: not found",
        "broken": "payload: connection reset",
        "short": "input_ids: length 4, the record says 2 tokens",
    }
    samples = result.samples
    assert samples.labels["rollout_id"] == ["good", "flat"]
    assert samples.numeric["step"].tolist() == [7.0, 7.0]
    assert samples.numeric["staleness"].tolist() == [5.0, 2.0], "step 7 minus policy versions 2 and 5"
    assert samples.numeric["num_tokens"].tolist() == [4.0, 4.0]
    assert samples.numeric["trainable_tokens"].tolist() == [3.0, 0.0], "loss tokens, none at zero advantage"
    assert samples.numeric["advantage"].tolist() == [0.5, 0.0]


def test_prune_rules() -> None:
    mask = np.array([False, True, True, False])
    assert token_rl_weights({"loss_mask": mask}, -0.5).tolist() == [0.0, 1.0, 1.0, 0.0]
    assert token_rl_weights({"loss_mask": mask}, 0.0).tolist() == [0.0, 0.0, 0.0, 0.0]
    assert token_rl_weights({"loss_mask": mask}, 0.0).dtype == np.float64
    assert token_rl_weights({"loss_mask": mask}, 2.0).dtype == np.float64
    assert count_trainable_tokens(mask, -0.5) == 2 and count_trainable_tokens(mask, 1.0) == 2
    assert count_trainable_tokens(mask, 0.0) == 0
    assert (
        has_training_signal(-0.1, 1) and not has_training_signal(0.0, 5) and not has_training_signal(0.3, 0)
    )


def test_prune_samples_keeps_one_trainable_token() -> None:
    builder = CohortBuilder()
    for rollout_id in ("a", "b", "c"):
        builder.append(dict.fromkeys(NUMERIC_COLUMNS, 0.0), {"rollout_id": rollout_id})
    cohort = builder.build().with_numeric(trainable_tokens=np.array([1.0, 0.0, 7.0]))
    kept, dropped = prune_samples(cohort)
    assert kept.labels["rollout_id"] == ["a", "c"] and dropped == ["b"]


def test_drop_reasons_and_their_fields() -> None:
    assert drop_reason(None) == "no_trainable_tokens"
    assert (
        drop_reason("loss_mask: missing from the payload")
        == "invalid_payload: loss_mask: missing from the payload"
    )
    drops = worker_drops(
        {"x": "payload: not found", "y": "input_ids: length 3, the record says 4 tokens"}, ["z"]
    )
    assert drops == {
        "x": "invalid_payload: payload: not found",
        "y": "invalid_payload: input_ids: length 3, the record says 4 tokens",
        "z": "no_trainable_tokens",
    }
    assert [drop_field(r) for r in drops.values()] == ["payload", "input_ids", "no_trainable_tokens"]
    assert worker_drops({}, []) == {}
