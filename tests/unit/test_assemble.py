"""A rank's payload joined from wire parts prepared before the cut is, byte for byte, the
payload the encoder builds from the arrays: the oracle is `encode_rank` (the micro-batch
built and encoded whole), and MessagePack's own `packb` for the elements."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.cohort import NUMERIC_COLUMNS, CohortBuilder
from tasks.stages.encode import SampleWire, assemble_rank, encode_rank, prepare_samples
from tasks.stages.pack import MicroBatchPlan
from transport.codec import array_elements, array_header


def _sample(rng: np.random.Generator, tokens: int, big_ids: bool, credit: int = 0) -> dict[str, np.ndarray]:
    """A rollout's required arrays; with `credit` (a bit per stream) its own advantages (some
    zero), temperatures, and rl weights (with advantages only: else it is not prepared)."""
    high = 2**40 if big_ids else 1000
    arrays = {
        "input_ids": rng.integers(0, high, tokens).astype(np.int64 if big_ids else np.int32),
        "loss_mask": rng.random(tokens) < 0.6,
        "inference_logprobs": -rng.random(tokens).astype(np.float32),
    }
    if credit & 1:
        arrays["advantages"] = np.where(rng.random(tokens) < 0.3, 0.0, rng.normal(size=tokens)).astype(
            np.float32
        )
    if credit & 2:
        arrays["temperatures"] = rng.uniform(0.5, 1.5, tokens)
    if credit & 5 == 5:
        arrays["rl_weights"] = rng.random(tokens)
    return arrays


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=9),
    advantages=st.lists(st.sampled_from([0.0, 0.25, -1.5, 3.0]), min_size=9, max_size=9),
    envs=st.lists(st.sampled_from(["math", "code", "x" * 40]), min_size=9, max_size=9),  # str8 beyond 31
    split=st.integers(0, 9),
    paddings=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    big_ids=st.booleans(),
    credit=st.lists(st.integers(0, 7), min_size=9, max_size=9),
    seed=st.integers(0, 2**16),
)
def test_joined_payload_equals_the_encoded_one(
    lengths, advantages, envs, split, paddings, big_ids, credit, seed
) -> None:
    rng = np.random.default_rng(seed)
    builder = CohortBuilder()
    arrays = {}
    for i, length in enumerate(lengths):
        numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {"advantage": advantages[i], "temperature": 0.5 + i}
        builder.append(numeric, {"rollout_id": f"r{i}", "env": envs[i]})
        arrays[f"r{i}"] = _sample(rng, length, big_ids, credit[i])
    samples = builder.build()
    order = list(rng.permutation(len(lengths)))
    cut = min(split, len(order))
    plans = [
        MicroBatchPlan([int(i) for i in order[:cut]], sum(lengths[i] for i in order[:cut]), paddings[0]),
        MicroBatchPlan([int(i) for i in order[cut:]], sum(lengths[i] for i in order[cut:]), paddings[1]),
        MicroBatchPlan([], 0, 0),
    ]
    wires = {rid: SampleWire.from_bytes(wire.to_bytes()) for rid, wire in prepare_samples(arrays).items()}
    assert set(wires) == set(arrays), "every rollout prepared: required arrays and own credit streams"
    assert assemble_rank(plans, samples, wires) == bytes(encode_rank(plans, samples, arrays))


def test_the_elements_are_msgpacks_own() -> None:
    values = np.array([0, 127, 128, 255, 256, 65535, 65536, -1, -32, -33, -129, 2**33, -(2**40)], np.int64)
    assert array_header(len(values)) + array_elements("input_ids", values) == msgpack.packb(values.tolist())
    floats = np.array([0.0, -0.5, 1e300], np.float64)
    assert array_header(3) + array_elements("advantages", floats) == msgpack.packb(floats.tolist())
    mask = np.array([True, False])
    assert array_header(2) + array_elements("loss_mask", mask) == msgpack.packb([True, False])


def test_a_rollout_with_more_than_the_required_arrays_is_not_prepared() -> None:
    arrays = _sample(np.random.default_rng(0), 5, False)
    prepared = prepare_samples({
        "plain": arrays,
        "ref": arrays | {"ref_logprobs": np.zeros(5, np.float32)},
        "moe": arrays | {"routed_experts": np.zeros((5, 2, 2), np.uint8)},
    })  # fmt: skip
    assert list(prepared) == ["plain"]


@pytest.mark.parametrize("tokens", [0, 1, 200])
def test_the_wire_reads_back_its_tokens(tokens: int) -> None:
    arrays = _sample(np.random.default_rng(tokens), tokens, False)
    back = SampleWire.from_bytes(prepare_samples({"r": arrays})["r"].to_bytes()).token_arrays()
    assert back["input_ids"].tolist() == arrays["input_ids"].tolist()
    assert back["loss_mask"].tolist() == arrays["loss_mask"].tolist()
