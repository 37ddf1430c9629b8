"""The producer's checks of the credit streams a rollout may carry (`advantages`,
`rl_weights`, `temperatures`): each refusal names the rollout, the field and the value, in
`RolloutRejected.problems`, against hand-written cases."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.records import RolloutRecord
from orchestrator.rollout_checks import RolloutRejected, check_rollouts
from rlship import OPTIONAL_TOKEN_ARRAYS


def _record(rollout_id: str = "r0", tokens: int = 4) -> RolloutRecord:
    return RolloutRecord(
        rollout_id=rollout_id, group_id="g", task_id="t", env="e", policy_version=0, reward=1.0,
        num_input_tokens=1, num_output_tokens=tokens - 1,
    )  # fmt: skip


def _arrays(n: int = 4, **extra: object) -> dict[str, object]:
    return {
        "input_ids": np.arange(n),
        "loss_mask": np.arange(n) >= 1,
        "inference_logprobs": np.full(n, -0.5),
    } | extra


def _problems(**extra: object) -> dict[str, str]:
    with pytest.raises(RolloutRejected) as caught:
        check_rollouts([(_record(), _arrays(**extra))], max_tokens=16, vocab_size=100)
    return caught.value.problems


def test_the_agreed_names_are_public() -> None:
    assert {"advantages", "rl_weights", "temperatures"} <= set(OPTIONAL_TOKEN_ARRAYS)


def test_well_formed_credit_streams_pass() -> None:
    given = {
        "advantages": np.array([0.0, 0.5, -1.0, 0.0], dtype=np.float32),
        "rl_weights": [0.0, 1.0, 0.5, 1.0],
        "temperatures": np.array([1.0, 0.7, 0.7, 0.7]),
    }
    checked = check_rollouts([(_record(), _arrays(**given))], max_tokens=16, vocab_size=100)
    assert checked[0]["advantages"].tolist() == [0.0, 0.5, -1.0, 0.0]


@pytest.mark.parametrize("name", ["advantages", "rl_weights", "temperatures"])
def test_a_misaligned_stream_is_named(name: str) -> None:
    assert _problems(**{name: np.ones(3)}) == {"r0": f"{name}: length 3, expected 4 (len(input_ids))"}


@pytest.mark.parametrize("name", ["advantages", "rl_weights", "temperatures"])
def test_a_non_finite_value_is_named(name: str) -> None:
    values = np.array([1.0, 1.0, np.nan, 1.0])
    assert _problems(**{name: values}) == {"r0": f"{name}: non-finite value nan"}


@pytest.mark.parametrize("name", ["advantages", "rl_weights", "temperatures"])
def test_a_stream_of_integers_is_refused(name: str) -> None:
    problem = _problems(**{name: np.array([1, 1, 1, 1])})["r0"]
    assert problem == f"{name}: dtype int64, expected floats (float16, float32 or float64)"


def test_a_temperature_not_above_zero_is_named_with_its_token() -> None:
    assert _problems(temperatures=np.array([1.0, 1.0, 0.0, 1.0])) == {
        "r0": "temperatures: value 0.0 at token 2, expected > 0"
    }
