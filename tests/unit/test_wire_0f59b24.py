"""The `prime-rl-0f59b24` wire profile: what rlship's encoder writes is what prime-rl's
msgspec structs at that commit encode for the same values (their structs written apart from
ours, tests/support/prime_0f59b24.py), byte for byte, and what they decode is the rollouts'
own tokens and side-array rows, read back from the files through the handles."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.cohort import NUMERIC_COLUMNS, CohortBuilder
from tasks.stages.encode import SampleWire, assemble_rank, encode_rank, prepare_samples, rank_segments
from tasks.stages.pack import MicroBatchPlan
from tests.support import prime_0f59b24 as prime
from transport.codec import decode_microbatches
from transport.payload_segments import (
    SegmentReadError,
    digests_checksum,
    read_side_arrays,
    write_segment_file,
)
from transport.schema import WIRE_0F59B24, WIRE_559B447, EncodedTensor, SchemaError

LAYERS, TOPK = 48, 8


def _step(tmp_path, lengths: list[int], with_experts: list[bool], seed: int = 0):
    rng = np.random.default_rng(seed)
    builder = CohortBuilder()
    arrays, experts = {}, {}
    for i, length in enumerate(lengths):
        rid = f"r{i}"
        numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {"advantage": 0.5 - i, "temperature": 1.0}
        builder.append(numeric, {"rollout_id": rid, "env": "math"})
        arrays[rid] = {
            "input_ids": rng.integers(0, 5000, length).astype(np.int32),
            "loss_mask": rng.random(length) < 0.7,
            "inference_logprobs": -rng.random(length).astype(np.float32),
        }
        if with_experts[i]:
            experts[rid] = rng.integers(0, 128, (length, LAYERS, TOPK), dtype=np.uint8)
            arrays[rid]["payload"] = write_segment_file(
                tmp_path / f"{rid}.rows", {"routed_experts": experts[rid]}
            )
    return builder.build(), arrays, experts


def _plans(lengths: list[int]) -> list[MicroBatchPlan]:
    first = [0, 1]
    rest = list(range(2, len(lengths)))
    return [
        MicroBatchPlan(first, sum(lengths[i] for i in first), 3),
        MicroBatchPlan(rest, sum(lengths[i] for i in rest), 0),
    ]


def test_the_payload_is_prime_rls_encoding_of_the_same_values(tmp_path) -> None:
    lengths = [7, 40, 0, 25, 12]
    samples, arrays, experts = _step(tmp_path, lengths, [True, False, True, True, True])
    plans = _plans(lengths)
    payload = bytes(encode_rank(plans, samples, arrays, WIRE_0F59B24))
    decoded = prime.decode_payload(payload)
    assert len(decoded) == 2
    # prime-rl's own encoder writes the decoded structs back to the same bytes.
    assert prime.encode_payload(decoded) == payload
    first = decoded[0]
    assert first.trace_ids == ["r0", "r1", ""] and first.branch_indices == [0, 0, -1]
    assert first.routed_experts is None and first.mm_refs is None
    assert [s.field for s in first.payload] == ["routed_experts"]  # r1 has none
    assert first.payload[0].pos == 0 and first.payload[0].rows == 7
    # r2 (no tokens) has no rows to carry; r3 and r4 follow it at their places.
    assert [(s.pos, s.rows) for s in decoded[1].payload] == [(0, 25), (25, 12)]
    for batch in decoded:
        for trace, rows in prime.sequence_rows(batch, "routed_experts").items():
            # A sequence without rows reads as the trainer's fill (expert 0).
            expected = experts.get(trace, np.zeros((lengths[int(trace[1:])], LAYERS, TOPK), np.uint8))
            assert rows == expected.tobytes(), trace


def test_a_window_read_by_pread_is_the_producers_rows(tmp_path) -> None:
    lengths = [30, 20, 50]
    samples, arrays, experts = _step(tmp_path, lengths, [True, True, True], seed=3)
    plans = [MicroBatchPlan([0, 1, 2], 100, 0)]
    (batch,) = prime.decode_payload(bytes(encode_rank(plans, samples, arrays, WIRE_0F59B24)))
    window = prime.read_window(batch.payload, "routed_experts", 25, 60, np.uint8)
    expected = np.concatenate([experts["r0"], experts["r1"], experts["r2"]])[25:60]
    assert np.array_equal(window, expected)


@pytest.mark.parametrize("padding", [0, 5])
def test_the_joined_payload_equals_the_encoded_one_with_handles(tmp_path, padding) -> None:
    lengths = [9, 14, 3, 30]
    samples, arrays, _ = _step(tmp_path, lengths, [True, False, True, True], seed=7)
    plans = [MicroBatchPlan([0, 1], 23, padding), MicroBatchPlan([2, 3], 33, 0), MicroBatchPlan([], 0, 0)]
    wires = {rid: SampleWire.from_bytes(w.to_bytes()) for rid, w in prepare_samples(arrays).items()}
    assert set(wires) == set(arrays)  # a rollout with handles is prepared too
    joined = assemble_rank(plans, samples, wires, WIRE_0F59B24)
    assert joined == bytes(encode_rank(plans, samples, arrays, WIRE_0F59B24))
    assert prime.encode_payload(prime.decode_payload(joined)) == joined


def test_rlships_decoder_reads_the_profile_and_the_rows_checksums_agree(tmp_path) -> None:
    lengths = [11, 6, 21]
    samples, arrays, _ = _step(tmp_path, lengths, [True, True, True], seed=5)
    plans = [MicroBatchPlan([0, 1, 2], 38, 2)]
    payload = encode_rank(plans, samples, arrays, WIRE_0F59B24)
    (batch,) = decode_microbatches(payload, WIRE_0F59B24)
    assert batch.trace_ids == ["r0", "r1", "r2", ""]
    sent = rank_segments(plans, samples, {rid: a["payload"] for rid, a in arrays.items()})
    assert read_side_arrays([batch]) == digests_checksum(s.digest for s in sent)
    (tmp_path / "r1.rows").write_bytes(b"\0" * (6 * LAYERS * TOPK))  # same size, other rows
    assert read_side_arrays([batch]) != digests_checksum(s.digest for s in sent)
    (tmp_path / "r1.rows").write_bytes(b"\0" * (5 * LAYERS * TOPK))  # a row short
    with pytest.raises(
        SegmentReadError,
        match=r"^payload.routed_experts: short read from .*r1.rows at byte 0: 1920 of 2304 bytes$",
    ):
        read_side_arrays([batch])


def test_a_wire_without_a_place_for_handles_refuses_them(tmp_path) -> None:
    lengths = [5, 6]
    samples, arrays, _ = _step(tmp_path, lengths, [True, False])
    with pytest.raises(SchemaError, match=r"^payload: wire prime-rl-559b447 cannot carry it$"):
        encode_rank([MicroBatchPlan([0, 1], 11, 0)], samples, arrays, WIRE_559B447)


def test_mm_kwargs_have_no_place_in_0f59b24(tmp_path) -> None:
    samples, arrays, _ = _step(tmp_path, [4, 4], [False, False])
    arrays["r0"]["mm_kwargs.pixel_values"] = EncodedTensor.from_array(np.zeros((1, 3), np.float32))
    with pytest.raises(SchemaError, match=r"^mm_kwargs: wire prime-rl-0f59b24 cannot carry it$"):
        encode_rank([MicroBatchPlan([0, 1], 8, 0)], samples, arrays, WIRE_0F59B24)
