"""Per-token credit on the wire, exact bytes: a micro-batch of a rollout that carries its own
advantages, rl weights and temperatures beside one of the plain kind (its row's advantage and
temperature broadcast) must be the bytes `msgpack.packb` makes of the micro-batch written out
by hand from prime-rl's MicroBatch field order (559b447: 16 fields; 0f59b24: 20) and the rules
of docs/wire-format.md: given streams as given, the others broadcast, rl weight 1.0 on the loss
mask (or as given) and 0 on a loss token of zero advantage (prime-rl's train_sink), padding
0 / 1.0 for temperatures / "padding". Not rlship's codec or encoder helpers."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from tasks.cohort import NUMERIC_COLUMNS, CohortBuilder
from tasks.stages.encode import SampleWire, assemble_rank, encode_rank, prepare_samples
from tasks.stages.pack import MicroBatchPlan
from tests.support import prime_0f59b24
from transport.schema import WIRE_0F59B24, WIRE_559B447

ARRAYS = {
    # Given credit: advantages per token (zero on one loss token), rl weights and temperatures.
    "given": {
        "input_ids": np.array([5, 6, 7, 8], dtype=np.int32),
        "loss_mask": np.array([False, True, True, True]),
        "inference_logprobs": np.array([0.0, -0.5, -0.25, -1.0], dtype=np.float32),
        "advantages": np.array([0.0, 1.5, 0.0, -0.75], dtype=np.float32),
        "rl_weights": np.array([0.0, 0.5, 1.0, 2.0]),
        "temperatures": np.array([1.0, 0.7, 0.7, 0.6]),
    },
    # Given advantages only: rl weights follow the loss mask; temperature from its row.
    "adv_only": {
        "input_ids": np.array([9, 10, 11], dtype=np.int64),
        "loss_mask": np.array([True, False, True]),
        "inference_logprobs": np.array([-2.0, 0.0, -3.0]),
        "advantages": np.array([0.25, 9.0, 0.0]),
    },
    # The plain kind: the group baseline's advantage broadcast.
    "plain": {
        "input_ids": np.array([1, 2], dtype=np.int32),
        "loss_mask": np.array([False, True]),
        "inference_logprobs": np.array([0.0, -0.125], dtype=np.float32),
    },
}
ROWS = [("given", 0.1, 0.9, "math"), ("adv_only", 0.2, 1.25, "code"), ("plain", -0.5, 0.8, "math")]

# The expected per-token streams, written out by hand, in plan order (given, adv_only, plain),
# then two padding tokens.
INPUT_IDS = [5, 6, 7, 8, 9, 10, 11, 1, 2, 0, 0]
LOSS_MASK = [False, True, True, True, True, False, True, False, True, False, False]
ADVANTAGES = [0.0, 1.5, 0.0, -0.75, 0.25, 9.0, 0.0, -0.5, -0.5, 0.0, 0.0]
LOGPROBS = [0.0, -0.5, -0.25, -1.0, -2.0, 0.0, -3.0, 0.0, -0.125, 0.0, 0.0]
POSITIONS = [0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1]
LENGTHS = [4, 3, 2, 2]
TEMPERATURES = [1.0, 0.7, 0.7, 0.6, 1.25, 1.25, 1.25, 0.8, 0.8, 1.0, 1.0]
ENVS = ["math"] * 4 + ["code"] * 3 + ["math"] * 2 + ["padding"] * 2
# given: 0.5 kept, 1.0 -> 0 (zero advantage on a loss token), 2.0 kept, 0.0 outside the mask;
# adv_only: 1.0 on the loss mask but the zero-advantage loss token; plain: its loss token.
RL_WEIGHTS = [0.0, 0.5, 0.0, 2.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
PLAN = [MicroBatchPlan(samples=[0, 1, 2], tokens=9, padding=2)]


def _samples():
    builder = CohortBuilder()
    for rollout_id, advantage, temperature, env in ROWS:
        numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {"advantage": advantage, "temperature": temperature}
        builder.append(numeric, {"rollout_id": rollout_id, "env": env})
    return builder.build()


def _fields_559b447() -> list:
    return [
        INPUT_IDS, LOSS_MASK, ADVANTAGES, LOGPROBS, POSITIONS, LENGTHS, TEMPERATURES, ENVS, LENGTHS,
        None, None, None, None, RL_WEIGHTS, None, None,
    ]  # fmt: skip


def test_the_559b447_payload_is_the_hand_written_micro_batch() -> None:
    payload = bytes(encode_rank(PLAN, _samples(), ARRAYS, WIRE_559B447))
    assert payload == msgpack.packb([_fields_559b447()])


def test_the_0f59b24_payload_is_the_hand_written_micro_batch() -> None:
    payload = bytes(encode_rank(PLAN, _samples(), ARRAYS, WIRE_0F59B24))
    # 0f59b24: mm_refs where mm_kwargs was, then sampling_mask, trace_ids, branch_indices, payload.
    expected = [*_fields_559b447(), None, ["given", "adv_only", "plain", ""], [0, 0, 0, -1], None]
    assert payload == msgpack.packb([expected])
    [batch] = prime_0f59b24.decode_payload(payload)  # as a 0f59b24 trainer rank decodes it
    assert (batch.advantages, batch.rl_weights, batch.temperatures) == (ADVANTAGES, RL_WEIGHTS, TEMPERATURES)


def test_the_parts_prepared_before_the_cut_join_into_the_same_bytes() -> None:
    """Credit streams of their own are prepared with the rollout (given rl weights only with
    given advantages: else they follow the row's advantage)."""
    weights_only = {"w": ARRAYS["plain"] | {"rl_weights": np.array([0.0, 2.0])}}
    assert set(prepare_samples(ARRAYS | weights_only)) == {"given", "adv_only", "plain"}
    wires = {rid: SampleWire.from_bytes(wire.to_bytes()) for rid, wire in prepare_samples(ARRAYS).items()}
    assert assemble_rank(PLAN, _samples(), wires) == msgpack.packb([_fields_559b447()])


@pytest.mark.parametrize(
    ("name", "given", "expected"),
    [  # (stream, its values, the micro-batch's advantages, temperatures and rl weights)
        ("advantages", [0.0, 3.0], ([0.0, 3.0], [0.8, 0.8], [0.0, 1.0])),
        ("advantages", [2.0, 0.0], ([2.0, 0.0], [0.8, 0.8], [0.0, 0.0])),
        ("rl_weights", [0.25, 3.0], ([-0.5, -0.5], [0.8, 0.8], [0.25, 3.0])),
        ("temperatures", [0.5, 3.0], ([-0.5, -0.5], [0.5, 3.0], [0.0, 1.0])),
    ],
)
def test_each_given_stream_alone_is_carried(name: str, given: list[float], expected: tuple) -> None:
    """The plain rollout (loss mask [False, True], its row's advantage -0.5 and temperature
    0.8) with one stream of its own."""
    arrays = {"plain": ARRAYS["plain"] | {name: np.array(given)}}
    [batch] = msgpack.unpackb(bytes(encode_rank([MicroBatchPlan([0], 2, 0)], _samples().take([2]), arrays)))
    assert (batch[2], batch[6], batch[13]) == expected
