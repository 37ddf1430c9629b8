"""The payload codec against two independent encoders, msgpack and msgspec.

`encode_microbatches` must produce exactly the bytes `msgpack.packb` produces for the
same values as plain lists, and a msgspec array_like struct produces the same; decoding
must give back equal micro-batches, from our bytes and theirs.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.commands.bench.encode import WireEncodedTensor, WireMicroBatch, WireRoutedExperts
from tests.support.factories import make_batch
from transport._msgpack_arrays import CHUNK, SMALL, readers, writers
from transport.codec import (
    array_header,
    decode_microbatches,
    encode_microbatch,
    encode_microbatches,
    encode_microbatches_into,
    wire_size,
)
from transport.schema import EncodedTensor, MicroBatch, RoutedExperts

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT_BOUNDARIES = [
    INT64_MIN,
    -(1 << 31) - 1,
    -(1 << 31),
    -32769,
    -32768,
    -129,
    -128,
    -33,
    -32,
    -1,
    0,
    127,
    128,
    255,
    256,
    65535,
    65536,
    (1 << 32) - 1,
    1 << 32,
    INT64_MAX,
]
NAMES = ["", "math", "a" * 31, "b" * 32, "é" * 127, "c" * 255, "d" * 256, "数学-" * 30, "x" * 70000]
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def msgpack_oracle(batches: list[MicroBatch]) -> bytes:
    return msgpack.packb([b.as_wire_values() for b in batches], use_bin_type=True)


def msgspec_oracle(batches: list[MicroBatch]) -> bytes:
    """What prime-rl's msgspec encoder writes for the same values, built from the
    batches' own fields (not from our wire values)."""
    structs = []
    for b in batches:
        values = b.as_wire_values()
        if b.routed_experts is not None:
            e = b.routed_experts
            values[10] = WireRoutedExperts(e.data, list(e.shape), e.dtype)
        if b.mm_kwargs is not None:
            values[11] = {
                k: WireEncodedTensor(t.dtype, list(t.shape), t.data) for k, t in b.mm_kwargs.items()
            }
        structs.append(WireMicroBatch(*values))
    return msgspec.msgpack.Encoder().encode(structs)


def check_roundtrip(batches: list[MicroBatch]) -> bytes:
    """Every property at once: byte identity with both oracles, incremental == whole,
    wire_size, the `_into` variant, and decoding ours and theirs back to equal batches."""
    expected = msgpack_oracle(batches)
    encoded = encode_microbatches(batches)
    assert isinstance(encoded, memoryview) and len(encoded) == len(expected)
    assert bytes(encoded) == expected
    assert msgspec_oracle(batches) == expected
    assert array_header(len(batches)) + b"".join(encode_microbatch(b) for b in batches) == expected
    assert wire_size(batches) == len(expected)
    out = bytearray(len(expected) + 16)
    assert encode_microbatches_into(batches, out) == len(expected)
    assert out == expected + bytes(16)  # nothing written past the payload
    for payload in (expected, encoded, bytearray(expected)):
        decoded = decode_microbatches(payload)
        assert len(decoded) == len(batches)
        for mine, theirs in zip(decoded, batches, strict=True):
            assert mine.equals(theirs)
            assert mine.input_ids.dtype == np.int64 and mine.loss_mask.dtype == np.bool_
    return expected


# --- hypothesis ------------------------------------------------------------------------------

ints = st.one_of(
    st.sampled_from(INT_BOUNDARIES),
    st.integers(-40, 300),
    st.integers(-70000, 70000),
    st.integers(INT64_MIN, INT64_MAX),
)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([-0.0, 0.0, float("nan")]))
names = st.one_of(st.sampled_from(NAMES[:-1]), st.text(max_size=40))


def even_length(data: bytes) -> bytes:
    return data[: len(data) // 2 * 2]


@st.composite
def microbatches(draw: st.DrawFn) -> MicroBatch:
    n = draw(st.one_of(st.integers(0, 20), st.integers(0, 400)))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    lengths = list(np.diff([0, *cuts, n]).tolist()) if n or cuts else draw(st.sampled_from([[], [0]]))
    per_sample = draw(st.booleans())
    if per_sample:
        env_names = [name for length in lengths for name in [draw(names)] * length]
    else:
        env_names = draw(st.lists(names, min_size=n, max_size=n))

    def token_list(elements: st.SearchStrategy[Any]) -> list[Any]:
        return draw(st.lists(elements, min_size=n, max_size=n))

    def maybe(elements: st.SearchStrategy[Any]) -> list[Any] | None:
        return token_list(elements) if draw(st.booleans()) else None

    experts = None
    if draw(st.booleans()):
        dtype = draw(st.sampled_from(["int8", "int32", "uint16"]))
        layers, topk = draw(st.integers(1, 3)), draw(st.integers(1, 4))
        experts = RoutedExperts.from_array(np.arange(n * layers * topk, dtype=dtype).reshape(n, layers, topk))
    mm_kwargs = None
    if draw(st.booleans()):
        mm_kwargs = {
            name: EncodedTensor(dtype, (len(data) // size,), data)
            for name, (dtype, size, data) in draw(
                st.dictionaries(
                    st.one_of(st.sampled_from(["pixel_values", "image_grid_thw"]), names),
                    st.one_of(
                        st.tuples(st.just("uint8"), st.just(1), st.binary(max_size=300)),
                        st.tuples(st.just("bfloat16"), st.just(2), st.binary(max_size=64).map(even_length)),
                    ),
                    max_size=3,
                )
            ).items()
        }
    return MicroBatch(
        input_ids=np.array(token_list(ints), np.int64),
        loss_mask=np.array(token_list(st.booleans()), bool),
        advantages=np.array(token_list(floats), np.float64),
        inference_logprobs=np.array(token_list(floats), np.float64),
        position_ids=np.array(token_list(ints), np.int64),
        sequence_lengths=lengths,
        temperatures=np.array(token_list(floats), np.float64),
        env_names=env_names,
        seq_lens=lengths,
        ref_logprobs=maybe(floats),
        routed_experts=experts,
        mm_kwargs=mm_kwargs,
        mm_token_type_ids=maybe(ints),
        rl_weights=maybe(floats),
        ce_weights=maybe(floats),
        ref_kl_weights=maybe(floats),
    )


@SETTINGS
@given(st.lists(microbatches(), max_size=5))
def test_random_payloads_match_both_oracles(batches: list[MicroBatch]) -> None:
    check_roundtrip(batches)


@SETTINGS
@given(st.lists(ints, max_size=100), st.integers(0, 5000), st.integers(0, 2**32 - 1), st.integers(0, 63))
def test_int_arrays_match_msgpack(drawn: list[int], size: int, seed: int, max_shift: int) -> None:
    """The vectorised int writer and reader alone, on arrays long enough to vectorise:
    drawn values, then random ones of random widths."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(INT64_MIN, INT64_MAX, size, dtype=np.int64) >> rng.integers(max_shift, 64, size)
    array = np.concatenate([np.array(drawn, np.int64), noise])
    values = array.tolist()
    expected = msgpack.packb(values)[len(array_header(len(values))) :]
    assert writers.int_body_size(array) == len(expected)
    out = np.empty(len(expected), np.uint8)
    assert writers.write_ints(array, out, 0) == len(expected)
    assert out.tobytes() == expected
    decoded, end = readers.read_ints(np.frombuffer(expected, np.uint8), 0, len(values))
    if len(values) >= SMALL:  # shorter arrays are left to msgpack by design
        assert decoded is not None and end == len(expected)
        assert np.array_equal(decoded, array)


# --- explicit cases ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536])
def test_array_header_boundaries(n: int) -> None:
    rng = np.random.default_rng(n)
    check_roundtrip([make_batch(rng.integers(0, 150_000, n), sample_lengths=[n])])


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17])
def test_microbatch_count_boundaries(count: int) -> None:
    check_roundtrip([make_batch(np.arange(i * 7) - 20) for i in range(count)])


def test_65536_empty_microbatches() -> None:
    batches = [make_batch([], sample_lengths=[])] * 65536
    expected = msgpack_oracle(batches)
    assert expected[:5] == b"\xdd\x00\x01\x00\x00"
    assert bytes(encode_microbatches(batches)) == expected
    assert len(decode_microbatches(expected)) == 65536


@pytest.mark.parametrize("value", INT_BOUNDARIES)
def test_every_int_width_boundary(value: int) -> None:
    """Each boundary alone, repeated (a single-class chunk), and among mixed neighbours."""
    check_roundtrip([make_batch([value])])
    check_roundtrip([make_batch([value] * 100)])
    mixed = np.array([value, 0, -1, 300, value, 70000, -40000, value] * 20, np.int64)
    check_roundtrip([make_batch(mixed)])


def test_all_int_widths_across_chunks() -> None:
    """Several chunks of every width class, with boundaries at chunk edges."""
    rng = np.random.default_rng(7)
    widths = rng.integers(0, 64, 3 * CHUNK + 17)
    values = rng.integers(INT64_MIN, INT64_MAX, len(widths), dtype=np.int64) >> widths
    values[CHUNK - 4 : CHUNK + 4] = INT_BOUNDARIES[:8]
    values[-8:] = INT_BOUNDARIES[-8:]
    check_roundtrip([make_batch(values)])


def test_sequential_ints_whose_bytes_look_like_tags() -> None:
    """Position ids past 0xcc00 put tag-like bytes (0xcc-0xd3) in every element for
    hundreds of elements in a row: the reader's hard case."""
    values = np.arange(0, 3 * 65536 + 5000, dtype=np.int64)
    check_roundtrip([make_batch(values, sample_lengths=[len(values)])])
    check_roundtrip([make_batch(-values)])
    check_roundtrip([make_batch(values * 0x01010101)])


def test_int_field_at_the_end_of_the_payload() -> None:
    """The last field's word stores and loads must not run past the buffer."""
    for n in (64, 65, 100):
        for tail in ([127], [128], [65536], [1 << 40], [-(1 << 40)], [-33]):
            check_roundtrip([make_batch(np.arange(n), mm_token_type_ids=[*([1 << 33] * (n - 1)), *tail])])


def test_floats_nan_inf_signed_zero() -> None:
    special = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 5e-324, -1.7976931348623157e308]
    payload = check_roundtrip([make_batch(np.arange(70), floats=(special * 10)[:70], rl_weights=[-0.0] * 70)])
    decoded = decode_microbatches(payload)[0]
    assert np.signbit(decoded.rl_weights).all()


def test_empty_microbatches_and_nil_optionals() -> None:
    payload = check_roundtrip([make_batch([], sample_lengths=[]), make_batch([], sample_lengths=[0])])
    assert payload[1:4] == b"\xdc\x00\x10" and payload.count(b"\xc0") >= 12


def test_all_optionals_present() -> None:
    """Every optional stream prime-rl's trainer consumes, set at once, against msgspec:
    routed experts [tokens, layers, topk], mm_kwargs of several dtypes and sizes (bin8 to
    bin32, a 16-entry map), the per-token weights and token types."""
    n = 300
    rng = np.random.default_rng(3)
    pixels = rng.random((70_000, 3)).astype(np.float32)  # 840 KB: a bin32
    mm_kwargs = {
        "pixel_values": EncodedTensor.from_array(pixels),
        "image_grid_thw": EncodedTensor.from_array(np.array([[1, 14, 20]], np.int64)),
        "pixel_values_bf16": EncodedTensor("bfloat16", (4, 2), rng.bytes(16)),
        **{f"extra_{i}": EncodedTensor.from_array(np.arange(i, dtype=np.int16)) for i in range(13)},
    }
    batch = make_batch(
        rng.integers(0, 150_000, n),
        sample_lengths=[100, 200],
        ref_logprobs=-rng.random(n),
        routed_experts=RoutedExperts.from_array(rng.integers(0, 64, (n, 48, 8)).astype(np.uint8)),
        mm_kwargs=mm_kwargs,
        mm_token_type_ids=rng.integers(0, 3, n),
        rl_weights=rng.random(n),
        ce_weights=rng.random(n),
        ref_kl_weights=rng.random(n),
    )
    payload = check_roundtrip([batch, make_batch(np.arange(5))])
    decoded = msgspec.msgpack.Decoder(list[WireMicroBatch]).decode(payload)[0]
    assert decoded.mm_kwargs["image_grid_thw"] == WireEncodedTensor(
        "int64", [1, 3], np.array([[1, 14, 20]]).tobytes()
    )
    assert decoded.routed_experts.shape == [n, 48, 8]


@pytest.mark.parametrize("nbytes", [0, 255, 256, 65535, 65536])
def test_routed_experts_bin_boundaries(nbytes: int) -> None:
    experts = RoutedExperts.from_array(np.arange(nbytes, dtype=np.uint8).reshape(1, nbytes))
    check_roundtrip([make_batch([5], routed_experts=experts)])


@pytest.mark.parametrize("name", NAMES)
def test_env_name_lengths(name: str) -> None:
    """fixstr, str8, str16 (and str32 headers through `str_header`), non-ASCII."""
    check_roundtrip([make_batch(np.arange(80), sample_lengths=[30, 50], env_names=[name] * 80)])


def test_env_names_varying_per_token() -> None:
    """Runs that do not follow the samples, and runs of one token."""
    tokens = [NAMES[i % 4] for i in range(200)] + ["wordle"] * 100
    check_roundtrip([make_batch(np.arange(300), sample_lengths=[150, 150], env_names=tokens)])


def test_str_header_widths() -> None:
    for length in (0, 31, 32, 255, 256, 65535, 65536):
        assert writers.str_header(length) == msgpack.packb("a" * length)[: len(writers.str_header(length))]
    for length in (0, 255, 256, 65535, 65536):
        assert writers.bin_header(length) == msgpack.packb(b"a" * length)[: len(writers.bin_header(length))]


def test_decodes_non_canonical_shapes_through_the_general_path() -> None:
    """Floats written as ints by another producer, and env names in runs of one, still decode."""
    batch = make_batch(np.arange(100))
    values = batch.as_wire_values()
    values[2] = list(range(100))  # advantages as ints
    values[7] = ["a", "b"] * 50
    decoded = decode_microbatches(msgpack.packb([values], use_bin_type=True))[0]
    assert np.array_equal(decoded.advantages, np.arange(100.0))
    assert decoded.env_names == ["a", "b"] * 50
