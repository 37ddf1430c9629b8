"""Malformed micro-batches fail where they are built, and malformed payloads fail to decode,
each with a message that names what is wrong."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from transport.codec import CodecError, decode_microbatches, encode_microbatches
from transport.schema import MicroBatch, SchemaError


def fields(n: int = 100) -> dict:
    return {
        "input_ids": np.arange(n) * 1000,
        "loss_mask": np.ones(n, bool),
        "advantages": np.full(n, 0.5),
        "inference_logprobs": -np.ones(n),
        "position_ids": np.arange(n),
        "sequence_lengths": [n // 2, n - n // 2],
        "temperatures": np.ones(n),
        "env_names": ["math"] * n,
        "seq_lens": [n // 2, n - n // 2],
    }


def payload(count: int = 2) -> bytes:
    return bytes(encode_microbatches([MicroBatch(**fields()) for _ in range(count)]))


@pytest.mark.parametrize(
    "name", ["loss_mask", "advantages", "inference_logprobs", "position_ids", "temperatures", "env_names"]
)
def test_per_token_field_of_wrong_length(name: str) -> None:
    values = fields()
    values[name] = values[name][:99]
    with pytest.raises(SchemaError, match=rf"^{name}: length 99, expected 100 \(len\(input_ids\)\)"):
        MicroBatch(**values)


def test_optional_per_token_field_of_wrong_length() -> None:
    with pytest.raises(SchemaError, match=r"^ref_logprobs: length 101, expected 100"):
        MicroBatch(**fields(), ref_logprobs=np.zeros(101))


@pytest.mark.parametrize("name", ["seq_lens", "sequence_lengths"])
def test_sample_lengths_that_do_not_sum_to_the_tokens(name: str) -> None:
    values = fields()
    values[name] = [50, 49]
    with pytest.raises(SchemaError, match=rf"^{name}: sums to 99, expected 100"):
        MicroBatch(**values)


@pytest.mark.parametrize("cut", [1, 2, 5, 40, 300, 1000, -900, -1])
def test_truncated_payload(cut: int) -> None:
    data = payload()
    with pytest.raises(CodecError, match=r"truncated|expected an array"):
        decode_microbatches(data[:cut])


def test_every_truncation_point_fails_cleanly() -> None:
    data = payload(1)
    for end in range(len(data)):
        with pytest.raises(CodecError):
            decode_microbatches(data[:end])


def test_trailing_bytes() -> None:
    with pytest.raises(CodecError, match=r"^payload: 3 unexpected bytes after the micro-batch list$"):
        decode_microbatches(payload() + b"\x01\x02\x03")


@pytest.mark.parametrize("count", [15, 17])
def test_wrong_field_count(count: int) -> None:
    values = MicroBatch(**fields()).as_wire_values()
    values = values[:count] if count < 16 else [*values, None]
    data = msgpack.packb([values], use_bin_type=True)
    with pytest.raises(
        CodecError,
        match=rf"^micro-batch 0: expected an array of 16 fields \(prime-rl-559b447\), got {count} elements$",
    ):
        decode_microbatches(data)


def test_not_an_array() -> None:
    with pytest.raises(CodecError, match=r"^payload: expected an array of micro-batches, got dict$"):
        decode_microbatches(msgpack.packb({"a": 1}))
    expected = r"^micro-batch 1: expected an array of 16 fields \(prime-rl-559b447\), got str$"
    with pytest.raises(CodecError, match=expected):
        decode_microbatches(msgpack.packb([MicroBatch(**fields()).as_wire_values(), "x"], use_bin_type=True))


def test_decoded_fields_are_validated_and_named() -> None:
    good = MicroBatch(**fields()).as_wire_values()
    short = list(good)
    short[3] = short[3][:-1]
    with pytest.raises(CodecError, match=r"^micro-batch 1: inference_logprobs: length 99, expected 100"):
        decode_microbatches(msgpack.packb([good, short], use_bin_type=True))
    wrong_type = list(good)
    wrong_type[0] = [*good[0][:-1], "x"]
    with pytest.raises(CodecError, match=r"^micro-batch 0: input_ids: "):
        decode_microbatches(msgpack.packb([wrong_type], use_bin_type=True))
    too_big = list(good)
    too_big[4] = [*good[4][:-1], 1 << 63]
    with pytest.raises(CodecError, match=r"^micro-batch 0: position_ids: "):
        decode_microbatches(msgpack.packb([too_big], use_bin_type=True))
    bad_experts = list(good)
    bad_experts[10] = [b"\x00" * 3, [100], "int8"]
    with pytest.raises(CodecError, match=r"^micro-batch 0: routed_experts.data: length 3"):
        decode_microbatches(msgpack.packb([bad_experts], use_bin_type=True))


def test_invalid_utf8_is_a_codec_error() -> None:
    data = bytearray(payload(1))
    index = data.index(b"math")
    data[index] = 0xFF
    with pytest.raises(CodecError, match=r"^micro-batch 0: env_names: malformed MessagePack"):
        decode_microbatches(bytes(data))


@pytest.mark.parametrize(
    ("mm_kwargs", "message"),
    [
        ({"pixel_values": ["float32", [2, 3], b"\0" * 20]}, r"mm_kwargs.data: length 20 does not match"),
        ({"pixel_values": ["complex1024", [1], b"\0"]}, r"mm_kwargs.dtype: unknown dtype 'complex1024'"),
        ({7: ["uint8", [1], b"\0"]}, r"mm_kwargs: key 7 is not a str"),
        ({"pixel_values": b"raw"}, r"mm_kwargs\['pixel_values'\]: expected \[dtype, shape, data\]"),
        ([1, 2], r"mm_kwargs: expected a map of name to tensor, got list"),
    ],
)
def test_malformed_mm_kwargs_are_named(mm_kwargs, message) -> None:
    with pytest.raises(SchemaError, match=message):
        MicroBatch(**fields(), mm_kwargs=mm_kwargs)
