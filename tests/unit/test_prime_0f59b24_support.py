"""The test-side decoder of prime-rl's 0f59b24 trainer wire (tests/support/prime_0f59b24.py)
on real files: micro-batches built with its structs, side-array rows written with numpy,
encoded, decoded and read back through the window reader as a trainer rank reads them; and
the stock peer that decodes as that trainer (`--wire prime-rl-0f59b24`)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import msgpack
import msgspec
import numpy as np
import pytest

from tests.support.prime_0f59b24 import (
    MicroBatch,
    MMImageRef,
    MMRefs,
    PayloadReadError,
    PayloadSegment,
    RoutedExperts,
    SamplingMask,
    decode_payload,
    encode_payload,
    payload_fields,
    read_window,
    sequence_rows,
)
from tests.support.stock_peers import (
    DEFAULT_WIRE,
    payload_row_hashes,
    read_record,
    start_stock_peer,
    stock_peer_command,
)
from transport.checksum import payload_checksum

pytestmark = pytest.mark.timeout(60)

LAYERS, TOPK = 3, 2


def write_rows(path: Path, rows: np.ndarray, *, lead: bytes = b"") -> int:
    """Appends `lead` then `rows` (C-contiguous) to `path`; the byte offset of the rows."""
    with open(path, "ab") as out:
        out.write(lead)
        offset = out.tell()
        out.write(np.ascontiguousarray(rows).tobytes())
    return offset


def segment(field: str, path: Path, offset: int, pos: int, rows: np.ndarray) -> PayloadSegment:
    return PayloadSegment(
        field=field, file=str(path), offset=offset, pos=pos, rows=len(rows), dtype=rows.dtype.name,
        shape=list(rows.shape[1:]),
    )  # fmt: skip


def micro_batch(lengths: list[int], trace_ids: list[str] | None = None, **fields) -> MicroBatch:
    n = sum(lengths)
    return MicroBatch(
        input_ids=list(range(n)), loss_mask=[True] * n, advantages=[0.5] * n,
        inference_logprobs=[-1.0] * n,
        position_ids=[p for length in lengths for p in range(length)], sequence_lengths=lengths,
        temperatures=[1.0] * n, env_names=["env"] * len(lengths), seq_lens=lengths,
        trace_ids=trace_ids, **fields,
    )  # fmt: skip


def experts(rng: np.random.Generator, rows: int, dtype: str = "int32") -> np.ndarray:
    return rng.integers(0, 64, size=(rows, LAYERS, TOPK)).astype(dtype)


# --- the structs on the wire ---------------------------------------------------------------------


def test_a_full_micro_batch_round_trips_with_all_twenty_fields(tmp_path: Path):
    rng = np.random.default_rng(0)
    rows = experts(rng, 4)
    path = tmp_path / "side.bin"
    full = micro_batch(
        [4], ["t0"],
        ref_logprobs=[-0.5] * 4,
        routed_experts=RoutedExperts(data=b"\x01\x02", shape=[1, 1, 2], dtype="uint8"),
        mm_refs=MMRefs(images=[MMImageRef(url="file:///i.png", offset=3, length=9)]),
        mm_token_type_ids=[0, 1, 1, 0], rl_weights=[1.0] * 4, ce_weights=[0.0] * 4,
        ref_kl_weights=[0.25] * 4,
        sampling_mask=SamplingMask(ids=np.arange(2, dtype=np.int32).tobytes(), counts=b"\x02\0\0\0"),
        branch_indices=[3],
        payload=[segment("routed_experts", path, write_rows(path, rows), 0, rows)],
    )  # fmt: skip
    data = encode_payload([full])
    raw = msgpack.unpackb(data)
    assert len(raw) == 1 and len(raw[0]) == 20
    assert raw[0][19] == [["routed_experts", str(path), 0, 0, 4, "int32", [LAYERS, TOPK]]]
    assert decode_payload(data) == [full]


def test_omit_defaults_does_not_shorten_an_array_like_struct(tmp_path: Path):
    """prime-rl declares MicroBatch omit_defaults=True, but msgspec ignores the option for
    array_like structs (msgspec issue #720): its own sender writes all 20 elements."""
    plain = micro_batch([2, 1])
    with_trace = micro_batch([2, 1], ["a", ""])
    rows = experts(np.random.default_rng(1), 3)
    path = tmp_path / "side.bin"
    with_payload = micro_batch([2, 1], payload=[segment("routed_experts", path, 0, 0, rows)])
    raw = msgpack.unpackb(encode_payload([plain, with_trace, with_payload]))
    assert [len(mb) for mb in raw] == [20, 20, 20]
    assert raw[0][9:] == [None] * 11 and raw[1][17] == ["a", ""] and raw[1][18:] == [None, None]
    assert raw[2][9:19] == [None] * 10 and raw[2][19][0][0] == "routed_experts"
    # the nested structs too: RoutedExperts / SamplingMask have no defaults to drop
    inline = micro_batch([1], routed_experts=RoutedExperts(data=b"\x07", shape=[1, 1, 1], dtype="uint8"))
    assert msgpack.unpackb(encode_payload([inline]))[0][10] == [b"\x07", [1, 1, 1], "uint8"]


def test_a_sender_that_drops_trailing_unset_fields_still_decodes():
    """A shorter array (9 required fields, or up to the last one set) takes the defaults of
    the fields missing from its end: what a trainer decodes from a sender that does drop them."""
    for batch, length in [(micro_batch([3]), 9), (micro_batch([2, 1], ["a", ""]), 18)]:
        raw = msgpack.unpackb(encode_payload([batch]))[0][:length]
        assert decode_payload(msgpack.packb([raw])) == [batch]
    sixteen = msgpack.unpackb(encode_payload([micro_batch([3])]))[0][:16]  # a 559b447 sender's array
    (decoded,) = decode_payload(msgpack.packb([sixteen]))
    assert (decoded.sampling_mask, decoded.trace_ids, decoded.branch_indices, decoded.payload) == (None,) * 4
    with pytest.raises(msgspec.ValidationError, match="at least length 9"):
        decode_payload(msgpack.packb([sixteen[:8]]))


def test_extra_trailing_elements_are_skipped_not_checked():
    """msgspec skips what follows the 20th element, whatever it is: a newer sender's appended
    fields are invisible to this trainer, as the 0f59b24 fields are to a 559b447 one."""
    batch = micro_batch([1], ["t"])
    raw = msgpack.unpackb(encode_payload([batch]))[0]
    assert decode_payload(msgpack.packb([[*raw, "not a field", {"x": 1}]])) == [batch]


# --- the window reader --------------------------------------------------------------------------


def test_read_window_whole_and_clipped(tmp_path: Path):
    rows = experts(np.random.default_rng(2), 10)
    path = tmp_path / "side.bin"
    offset = write_rows(path, rows, lead=b"x" * 13)  # rows start mid-file
    segments = [segment("routed_experts", path, offset, 5, rows)]  # positions 5..15
    whole = read_window(segments, "routed_experts", 5, 15, np.int32)
    assert whole is not None and whole.dtype == np.int32 and np.array_equal(whole, rows)
    clipped = read_window(segments, "routed_experts", 8, 12, np.int32)
    assert np.array_equal(clipped, rows[3:7])
    # a window reaching past the segment: the uncovered positions hold the fill
    wide = read_window(segments, "routed_experts", 0, 18, np.int64, fill=-7)
    assert wide.shape == (18, LAYERS, TOPK) and wide.dtype == np.int64
    assert (wide[:5] == -7).all() and (wide[15:] == -7).all() and np.array_equal(wide[5:15], rows)
    assert read_window(segments, "routed_experts", 20, 30, np.int32).tolist() == [[[0] * TOPK] * LAYERS] * 10
    assert read_window(segments, "routed_experts", 7, 7, np.int32).shape == (0, LAYERS, TOPK)


def test_read_window_joins_segments_of_one_field_across_two_files(tmp_path: Path):
    rng = np.random.default_rng(3)
    first, second, third = experts(rng, 4), experts(rng, 3), experts(rng, 5)
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    segments = [
        segment("routed_experts", a, write_rows(a, first), 0, first),
        segment("routed_experts", b, write_rows(b, second, lead=b"\0" * 8), 4, second),
        segment("routed_experts", a, write_rows(a, third), 7, third),
    ]
    expected = np.concatenate([first, second, third])
    assert np.array_equal(read_window(segments, "routed_experts", 0, 12, np.int32), expected)
    assert np.array_equal(read_window(segments, "routed_experts", 2, 9, np.int32), expected[2:9])
    assert np.array_equal(read_window(segments, "routed_experts", 5, 6, np.int32), second[1:2])


def test_read_window_narrower_rows_fill_the_leading_entries_and_later_segments_win(tmp_path: Path):
    path = tmp_path / "mask.bin"
    narrow = np.array([[1], [2]], dtype=np.int32)
    wide = np.array([[3, 4, 5]], dtype=np.int32)
    later = np.array([[9, 9]], dtype=np.int32)
    segments = [
        segment("sampling_mask", path, write_rows(path, narrow), 0, narrow),
        segment("sampling_mask", path, write_rows(path, wide), 2, wide),
        segment("sampling_mask", path, write_rows(path, later), 1, later),  # overwrites position 1
    ]
    got = read_window(segments, "sampling_mask", 0, 3, np.int32, fill=-1)
    assert got.tolist() == [[1, -1, -1], [9, 9, -1], [3, 4, 5]]


def test_read_window_of_a_field_with_no_segment_is_none(tmp_path: Path):
    rows = experts(np.random.default_rng(4), 2)
    path = tmp_path / "side.bin"
    segments = [segment("routed_experts", path, write_rows(path, rows), 0, rows)]
    assert read_window(segments, "sampling_mask", 0, 2, np.int32) is None
    assert read_window([], "routed_experts", 0, 2, np.int32) is None


def test_a_short_read_names_the_file_and_offset(tmp_path: Path):
    rows = experts(np.random.default_rng(5), 4)
    path = tmp_path / "side.bin"
    offset = write_rows(path, rows[:3], lead=b"y" * 24)  # one row short of what the segment says
    segments = [segment("routed_experts", path, offset, 0, rows)]
    assert np.array_equal(read_window(segments, "routed_experts", 0, 3, np.int32), rows[:3])
    where = re.escape(f"{path} at offset {offset + rows[0].nbytes}")
    with pytest.raises(PayloadReadError, match=f"short payload read from {where}"):
        read_window(segments, "routed_experts", 1, 4, np.int32)


def test_a_missing_file_names_the_file_and_offset(tmp_path: Path):
    rows = experts(np.random.default_rng(6), 4)
    gone = tmp_path / "gone.bin"
    segments = [segment("routed_experts", gone, 40, 0, rows)]
    offset = 40 + 2 * rows[0].nbytes
    with pytest.raises(
        PayloadReadError, match=rf"payload file {re.escape(str(gone))} .* at offset {offset}:"
    ):
        read_window(segments, "routed_experts", 2, 4, np.int32)
    # a window the missing file's segment does not reach opens nothing
    assert (read_window(segments, "routed_experts", 4, 6, np.int32) == 0).all()


# --- rows per sequence --------------------------------------------------------------------------


def test_sequence_rows_gives_each_traces_bytes_and_skips_padding(tmp_path: Path):
    rng = np.random.default_rng(7)
    lengths, trace_ids = [3, 4, 2, 5], ["alpha", "beta", "", "gamma"]  # the third is padding
    named = [(t, n) for t, n in zip(trace_ids, lengths, strict=True) if t]
    per_trace = {t: experts(rng, n, "uint8") for t, n in named}
    masks = {t: rng.integers(0, 1000, size=(n, 4)).astype(np.int32) for t, n in named}
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    payload, pos = [], 0
    for trace_id, length in zip(trace_ids, lengths, strict=True):
        if trace_id:
            rows, path = per_trace[trace_id], (a if trace_id != "beta" else b)
            payload.append(segment("routed_experts", path, write_rows(path, rows), pos, rows))
            payload.append(segment("sampling_mask", b, write_rows(b, masks[trace_id]), pos, masks[trace_id]))
        pos += length
    (batch,) = decode_payload(encode_payload([micro_batch(lengths, trace_ids, payload=payload)]))
    assert payload_fields(batch) == ["routed_experts", "sampling_mask"]
    assert sequence_rows(batch, "routed_experts") == {t: rows.tobytes() for t, rows in per_trace.items()}
    assert sequence_rows(batch, "sampling_mask") == {t: rows.tobytes() for t, rows in masks.items()}
    assert sequence_rows(batch, "something_else") == {}
    assert sequence_rows(micro_batch(lengths, trace_ids), "routed_experts") == {}


def test_sequence_rows_fills_what_no_segment_covers_as_the_trainer_does(tmp_path: Path):
    path = tmp_path / "mask.bin"
    mask = np.array([[5, 6]], dtype=np.int32)
    batch = micro_batch(
        [2, 1], ["t", "u"], payload=[segment("sampling_mask", path, write_rows(path, mask), 1, mask)]
    )
    got = sequence_rows(batch, "sampling_mask")
    assert got == {
        "t": np.array([[-1, -1], [5, 6]], dtype=np.int32).tobytes(),
        "u": np.full((1, 2), -1, np.int32).tobytes(),
    }


def test_sequence_rows_needs_one_unique_trace_id_per_sequence(tmp_path: Path):
    rows = experts(np.random.default_rng(8), 3)
    path = tmp_path / "side.bin"
    payload = [segment("routed_experts", path, write_rows(path, rows), 0, rows)]
    for trace_ids, message in [
        (None, "no trace_ids"),
        (["a"], "1 trace_ids for 2"),
        (["a", "a"], "two sequences"),
    ]:
        with pytest.raises(ValueError, match=message):
            sequence_rows(micro_batch([2, 1], trace_ids, payload=payload), "routed_experts")


def test_sequence_rows_surfaces_a_failed_read(tmp_path: Path):
    rows = experts(np.random.default_rng(9), 3)
    batch = micro_batch([3], ["t"], payload=[segment("routed_experts", tmp_path / "gone.bin", 0, 0, rows)])
    with pytest.raises(PayloadReadError, match=r"gone\.bin"):
        sequence_rows(batch, "routed_experts")


# --- the stock peer decoding as that trainer ------------------------------------------------------


def step_with_side_files(tmp_path: Path, rng: np.random.Generator) -> tuple[list[MicroBatch], dict]:
    """Three micro-batches (one with no payload) and the rows' sha256 per trace and field."""
    path = tmp_path / "side.bin"
    first, second = experts(rng, 3), experts(rng, 2)
    mask = rng.integers(0, 50, size=(2, 3)).astype(np.int32)
    first_segment = segment("routed_experts", path, write_rows(path, first), 0, first)
    batches = [
        micro_batch([3, 1], ["t1", ""], payload=[first_segment]),
        micro_batch([2], ["t2"]),
        micro_batch([2], ["t3"], payload=[
            segment("routed_experts", path, write_rows(path, second), 0, second),
            segment("sampling_mask", path, write_rows(path, mask), 0, mask),
        ]),
    ]  # fmt: skip
    sha = lambda rows: hashlib.sha256(rows.tobytes()).hexdigest()  # noqa: E731
    return batches, {
        "t1": {"routed_experts": sha(first)},
        "t3": {"routed_experts": sha(second), "sampling_mask": sha(mask)},
    }


def test_payload_row_hashes_merge_over_the_steps_micro_batches(tmp_path: Path):
    batches, expected = step_with_side_files(tmp_path, np.random.default_rng(10))
    assert payload_row_hashes(decode_payload(encode_payload(batches))) == expected
    inline = msgspec.structs.replace(
        batches[0], routed_experts=RoutedExperts(data=b"\0", shape=[1, 1, 1], dtype="uint8")
    )
    with pytest.raises(ValueError, match="both inline and by handle"):
        payload_row_hashes([inline])


def test_the_command_line_names_a_wire_only_when_it_is_not_the_default(tmp_path: Path):
    assert DEFAULT_WIRE == "prime-rl-559b447"
    assert "--wire" not in stock_peer_command("fs", 0, tmp_path / "r", output_dir=tmp_path)
    command = stock_peer_command("fs", 0, tmp_path / "r", output_dir=tmp_path, wire="prime-rl-0f59b24")
    assert command[-2:] == ["--wire", "prime-rl-0f59b24"]


def write_step(output_dir: Path, step: int, data: bytes) -> None:
    directory = output_dir / "rollouts" / f"step_{step}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rank_0.bin").write_bytes(data)


def test_the_peer_records_the_rows_it_reads(tmp_path: Path):
    batches, expected = step_with_side_files(tmp_path, np.random.default_rng(11))
    data = encode_payload(batches)
    write_step(tmp_path, 1, data)
    write_step(tmp_path, 2, encode_payload([micro_batch([1], ["t9"])]))
    record = tmp_path / "rank0.jsonl"
    peer = start_stock_peer(
        "fs", 0, record, output_dir=tmp_path, steps=2, poll=0.05, announce=False, wire="prime-rl-0f59b24"
    )
    try:
        assert peer.wait(30) == 0, Path(f"{record}.log").read_text()
    finally:
        peer.kill()
    first, second = read_record(record)
    assert first["rows"] == expected and second["rows"] == {}
    assert first["sha256"] == hashlib.sha256(data).hexdigest() and first["micro_batches"] == 3
    assert first["xxh3_128"] == payload_checksum(data)
    assert set(first) == {
        "rank", "step", "topic", "topic_step", "sha256", "xxh3_128", "bytes", "micro_batches", "rows"
    }  # fmt: skip
    json.dumps(first)  # the line as written


def test_the_peer_stops_on_a_missing_side_file_without_recording_the_step(tmp_path: Path):
    rows = experts(np.random.default_rng(12), 2)
    gone = tmp_path / "gone.bin"
    batch = micro_batch([2], ["t"], payload=[segment("routed_experts", gone, 0, 0, rows)])
    write_step(tmp_path, 1, encode_payload([batch]))
    record = tmp_path / "rank0.jsonl"
    peer = start_stock_peer(
        "fs", 0, record, output_dir=tmp_path, steps=1, poll=0.05, announce=False, wire="prime-rl-0f59b24"
    )
    try:
        assert peer.wait(30) != 0
    finally:
        peer.kill()
    assert read_record(record) == []
    assert f"payload file {gone}" in Path(f"{record}.log").read_text()


def test_the_default_peer_decodes_sixteen_fields_and_records_no_rows(tmp_path: Path):
    rows = experts(np.random.default_rng(13), 1)
    path = tmp_path / "side.bin"
    batch = micro_batch(
        [1], ["t"], payload=[segment("routed_experts", path, write_rows(path, rows), 0, rows)]
    )
    data = encode_payload([batch])
    write_step(tmp_path, 1, data)
    record = tmp_path / "rank0.jsonl"
    peer = start_stock_peer("fs", 0, record, output_dir=tmp_path, steps=1, poll=0.05, announce=False)
    try:
        # the 20-field array decodes as 16 fields (the last 4 skipped), as on a 559b447 trainer
        assert peer.wait(30) == 0, Path(f"{record}.log").read_text()
    finally:
        peer.kill()
    (line,) = read_record(record)
    assert "rows" not in line and line["micro_batches"] == 1
    assert line["sha256"] == hashlib.sha256(data).hexdigest()
