"""MessagePack codec for a rank's step payload: a MessagePack array of MicroBatch arrays.

Encoding is canonical (SPEC.md): the bytes equal `msgpack.packb` of the same values as
plain lists, whether the micro-batches are encoded together or one at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from transport.schema import MICROBATCH_FIELDS, MicroBatch, RoutedExperts, SchemaError


class CodecError(ValueError):
    """A payload that is not a well-formed MessagePack list of MicroBatch."""


def array_header(length: int) -> bytes:
    """The smallest MessagePack array header for `length` elements."""
    if length < 16:
        return bytes([0x90 | length])
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


def encode_microbatch(batch: MicroBatch) -> bytes:
    """One micro-batch as a 16-element MessagePack array."""
    return msgpack.packb(batch.as_wire_values(), use_bin_type=True)


def encode_microbatches(batches: Sequence[MicroBatch]) -> bytes:
    """A rank's payload: the list header, then each micro-batch in order."""
    return b"".join([array_header(len(batches)), *(encode_microbatch(b) for b in batches)])


def _microbatch_from_values(index: int, values: Any) -> MicroBatch:
    if not isinstance(values, list) or len(values) != len(MICROBATCH_FIELDS):
        length = len(values) if isinstance(values, list) else type(values).__name__
        raise CodecError(
            f"micro-batch {index}: expected an array of {len(MICROBATCH_FIELDS)} fields, got {length}"
        )
    kwargs = dict(zip(MICROBATCH_FIELDS, values, strict=True))
    experts = kwargs["routed_experts"]
    try:
        if experts is not None:
            if not isinstance(experts, list) or len(experts) != 3:
                raise SchemaError(f"routed_experts: expected [data, shape, dtype], got {experts!r:.80}")
            kwargs["routed_experts"] = RoutedExperts(data=experts[0], shape=experts[1], dtype=experts[2])
        return MicroBatch(**kwargs)
    except SchemaError as exc:
        raise CodecError(f"micro-batch {index}: {exc}") from exc


def decode_microbatches(data: bytes | bytearray | memoryview) -> list[MicroBatch]:
    """Decode and validate a rank's payload; errors name the micro-batch and the field."""
    try:
        values = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except msgpack.ExtraData as exc:
        raise CodecError(f"payload: {len(exc.extra)} unexpected bytes after the micro-batch list") from exc
    except (msgpack.OutOfData, ValueError) as exc:
        raise CodecError(f"payload: truncated or malformed MessagePack ({len(data)} bytes): {exc}") from exc
    if not isinstance(values, list):
        raise CodecError(f"payload: expected an array of micro-batches, got {type(values).__name__}")
    return [_microbatch_from_values(i, v) for i, v in enumerate(values)]
