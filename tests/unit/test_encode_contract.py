"""What a trainer rank decodes, field by field, against the rollouts that went in.

The oracle is plain `msgpack.unpackb` on the encoded payload and expected values written out
by hand from the input arrays (Python lists), never the project's codec or schema helpers.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from tasks.cohort import NUMERIC_COLUMNS, CohortBuilder
from tasks.stages.encode import encode_rank, rank_rollout_ids
from tasks.stages.pack import MicroBatchPlan

# Sample "a": 3 tokens (prompt 1, completion 2); sample "b": 2 tokens; sample "z": zero advantage.
ARRAYS: dict[str, dict[str, np.ndarray]] = {
    "a": {
        "input_ids": np.array([11, 12, 13], dtype=np.int32),
        "loss_mask": np.array([False, True, True]),
        "inference_logprobs": np.array([-0.5, -0.25, -0.125], dtype=np.float32),
        "ref_logprobs": np.array([-1.5, -1.25, -1.125], dtype=np.float32),
        "routed_experts": np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int16),
    },
    "b": {
        "input_ids": np.array([21, 22], dtype=np.int32),
        "loss_mask": np.array([True, False]),
        "inference_logprobs": np.array([-2.0, -4.0], dtype=np.float32),
        "ref_logprobs": np.array([-3.0, -5.0], dtype=np.float32),
        "routed_experts": np.array([[7, 8], [9, 10]], dtype=np.int16),
    },
    "z": {
        "input_ids": np.array([31, 32], dtype=np.int32),
        "loss_mask": np.array([True, True]),
        "inference_logprobs": np.array([-0.75, -0.5], dtype=np.float32),
    },
}
SAMPLES = [  # (rollout_id, advantage, temperature, env)
    ("a", 0.5, 0.7, "math"),
    ("b", -1.5, 1.3, "code"),
    ("z", 0.0, 0.9, "math"),
]


def _samples():
    builder = CohortBuilder()
    for rollout_id, advantage, temperature, env in SAMPLES:
        numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {"advantage": advantage, "temperature": temperature}
        builder.append(numeric, {"rollout_id": rollout_id, "env": env})
    return builder.build()


def _decode(payload: Any) -> list[list[Any]]:
    return msgpack.unpackb(bytes(payload), raw=False)


def test_each_field_is_what_the_rollouts_said_with_padding() -> None:
    """Samples in plan order (b before a), then three padding tokens."""
    [batch] = _decode(encode_rank([MicroBatchPlan(samples=[1, 0], tokens=5, padding=3)], _samples(), ARRAYS))
    assert len(batch) == 16
    assert batch[0] == [21, 22, 11, 12, 13, 0, 0, 0], "input_ids"
    assert batch[1] == [True, False, False, True, True, False, False, False], "loss_mask"
    assert batch[2] == [-1.5, -1.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0], "advantages"
    assert batch[3] == [-2.0, -4.0, -0.5, -0.25, -0.125, 0.0, 0.0, 0.0], "inference_logprobs"
    assert batch[4] == [0, 1, 0, 1, 2, 0, 1, 2], "position_ids restart per sample and for the padding"
    assert batch[5] == [2, 3, 3], "sequence_lengths"
    assert batch[6] == [1.3, 1.3, 0.7, 0.7, 0.7, 1.0, 1.0, 1.0], "temperatures (padding 1.0)"
    assert batch[7] == ["code", "code", "math", "math", "math", "padding", "padding", "padding"], "env_names"
    assert batch[8] == [2, 3, 3], "seq_lens"
    assert batch[9] == [-3.0, -5.0, -1.5, -1.25, -1.125, 0.0, 0.0, 0.0], "ref_logprobs"
    experts = np.array([[7, 8], [9, 10], [1, 2], [3, 4], [5, 6], [0, 0], [0, 0], [0, 0]], dtype=np.int16)
    assert batch[10] == [experts.tobytes(), [8, 2], "int16"], "routed_experts"
    assert batch[11] is None and batch[12] is None, "mm_kwargs, mm_token_type_ids"
    assert batch[13] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], (
        "rl_weights: loss tokens of non-zero advantage"
    )
    assert batch[14] is None and batch[15] is None, "ce_weights, ref_kl_weights"
    assert all(isinstance(v, float) for v in batch[2] + batch[3] + batch[6] + batch[9] + batch[13])


def test_zero_advantage_sample_has_zero_rl_weight_and_no_optional_arrays_unless_all_have_them() -> None:
    """`z` has neither ref logprobs nor routed experts, so the micro-batch carries neither."""
    [batch] = _decode(encode_rank([MicroBatchPlan(samples=[0, 2], tokens=5)], _samples(), ARRAYS))
    assert batch[0] == [11, 12, 13, 31, 32]
    assert batch[2] == [0.5, 0.5, 0.5, 0.0, 0.0]
    assert batch[4] == [0, 1, 2, 0, 1]
    assert batch[5] == [3, 2] and batch[8] == [3, 2]
    assert batch[6] == [0.7, 0.7, 0.7, 0.9, 0.9]
    assert batch[7] == ["math"] * 5
    assert batch[9] is None, "ref_logprobs only when every sample has them"
    assert batch[10] is None, "routed_experts only when every sample has them"
    assert batch[13] == [0.0, 1.0, 1.0, 0.0, 0.0], "zero advantage: zero rl weight even on loss tokens"


def test_without_padding_there_is_no_padding_segment() -> None:
    [batch] = _decode(encode_rank([MicroBatchPlan(samples=[0, 1], tokens=5)], _samples(), ARRAYS))
    assert batch[0] == [11, 12, 13, 21, 22]
    assert batch[5] == [3, 2] and batch[8] == [3, 2]
    assert batch[7] == ["math"] * 3 + ["code"] * 2
    experts = np.array([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], dtype=np.int16)
    assert batch[10] == [experts.tobytes(), [5, 2], "int16"]


def test_padding_only_and_empty_micro_batches() -> None:
    padding_only, empty = _decode(
        encode_rank(
            [MicroBatchPlan(samples=[], tokens=0, padding=2), MicroBatchPlan(samples=[], tokens=0)],
            _samples(),
            ARRAYS,
        )
    )
    assert padding_only[:9] == [
        [0, 0],
        [False, False],
        [0.0, 0.0],
        [0.0, 0.0],
        [0, 1],
        [2],
        [1.0, 1.0],
        ["padding", "padding"],
        [2],
    ]
    assert padding_only[9] is None and padding_only[10] is None and padding_only[13] == [0.0, 0.0]
    assert empty[:9] == [[], [], [], [], [], [], [], [], []]
    assert empty[9] is None and empty[10] is None and empty[13] == []


def test_a_rank_payload_is_its_micro_batches_in_plan_order() -> None:
    plans = [MicroBatchPlan(samples=[2], tokens=2), MicroBatchPlan(samples=[1, 0], tokens=5, padding=1)]
    batches = _decode(encode_rank(plans, _samples(), ARRAYS))
    assert [b[0] for b in batches] == [[31, 32], [21, 22, 11, 12, 13, 0]]
    assert rank_rollout_ids(plans, _samples()) == ["z", "b", "a"]


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_input_ids_of_any_integer_dtype_ship_as_their_values(dtype: type) -> None:
    arrays = {**ARRAYS, "z": {**ARRAYS["z"], "input_ids": np.array([0, 65535], dtype=dtype)}}
    [batch] = _decode(encode_rank([MicroBatchPlan(samples=[2], tokens=2)], _samples(), arrays))
    assert batch[0] == [0, 65535]


def test_one_sample_with_routed_experts_and_padding() -> None:
    """The padding's expert rows take the shape and dtype of the only sample's."""
    [batch] = _decode(encode_rank([MicroBatchPlan(samples=[1], tokens=2, padding=2)], _samples(), ARRAYS))
    experts = np.array([[7, 8], [9, 10], [0, 0], [0, 0]], dtype=np.int16)
    assert batch[10] == [experts.tobytes(), [4, 2], "int16"]
    assert batch[9] == [-3.0, -5.0, 0.0, 0.0]
