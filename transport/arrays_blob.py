"""A rollout's arrays as one compact binary blob: a MessagePack map of name -> [dtype, shape,
raw bytes] (side-array segments and multimodal tensors in their own forms) that decodes into
zero-copy numpy views. The store keeps the blob under the rollout's claim-check key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from transport.payload_segments import PAYLOAD_FIELD, PayloadSegment
from transport.schema import MM_KWARGS_PREFIX, EncodedTensor, SchemaError, as_encoded_tensors, as_segments


class PayloadCorruptError(ValueError):
    """A stored value that does not decode as an array blob."""


def flat_arrays(arrays: Mapping[str, Any]) -> dict[str, Any]:
    """A rollout's arrays with its `mm_kwargs` (a map of name -> tensor: an EncodedTensor or
    a numpy array) stored flat, as `mm_kwargs.{name}` -> EncodedTensor, and its side arrays
    by handle (`payload`) as a list of `PayloadSegment`. SchemaError names a malformed
    tensor or segment."""
    out: dict[str, Any] = {}
    for name, value in arrays.items():
        if name == PAYLOAD_FIELD:
            out[name] = as_segments(value)
        elif name == "mm_kwargs":
            if not isinstance(value, Mapping):
                raise SchemaError(f"mm_kwargs: expected a map of name to tensor, got {type(value).__name__}")
            tensors = as_encoded_tensors(dict(value))
            out.update({MM_KWARGS_PREFIX + kwarg: tensor for kwarg, tensor in tensors.items()})
        elif name.startswith(MM_KWARGS_PREFIX):
            out[name] = as_encoded_tensors({name[len(MM_KWARGS_PREFIX) :]: value}).popitem()[1]
        else:
            out[name] = value
    return out


# How a rollout's segments are held in its blob, beside its arrays' [dtype, shape, data].
_SEGMENTS_DTYPE = "segments"


def pack_arrays(arrays: Mapping[str, Any]) -> bytes:
    """Arrays to one compact blob: no JSON lists, one copy of each array's bytes. An
    mm_kwargs tensor keeps the producer's dtype name (it may be one numpy lacks)."""
    entries: dict[str, list[Any]] = {}
    for name, value in flat_arrays(arrays).items():
        if name == PAYLOAD_FIELD:
            stored = msgpack.packb([segment.to_stored() for segment in value], use_bin_type=True)
            entries[name] = [_SEGMENTS_DTYPE, [len(value)], stored]
            continue
        if isinstance(value, EncodedTensor):
            entries[name] = [value.dtype, list(value.shape), value.data]
            continue
        array = np.ascontiguousarray(value)
        data = memoryview(array).cast("B") if array.size else b""  # no cast of a zero in the shape
        entries[name] = [array.dtype.str, list(array.shape), data]
    return msgpack.packb(entries, use_bin_type=True)


def unpack_arrays(blob: bytes, key: str = "<blob>") -> dict[str, Any]:
    """The inverse of `pack_arrays`: arrays are read-only views into `blob`, mm_kwargs
    tensors EncodedTensor. PayloadCorruptError names the entry that does not decode."""
    try:
        entries = msgpack.unpackb(blob, raw=False)
        if not isinstance(entries, dict):
            raise TypeError(f"expected a map, got {type(entries).__name__}")
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise PayloadCorruptError(f"{key}: stored arrays do not decode ({exc})") from exc
    arrays = {}
    for name, entry in entries.items():
        try:
            arrays[name] = _unpack_entry(name, entry)
        except (ValueError, TypeError, SyntaxError, msgpack.UnpackException) as exc:  # SyntaxError: a dtype
            raise PayloadCorruptError(f"{key}: stored arrays do not decode (entry {name!r}: {exc})") from exc
    return arrays


def _unpack_entry(name: str, entry: Any) -> Any:
    dtype, shape, data = entry
    if name.startswith(MM_KWARGS_PREFIX):
        return EncodedTensor(dtype, shape, data)
    if dtype == _SEGMENTS_DTYPE:
        return [PayloadSegment.from_values(values) for values in msgpack.unpackb(data, raw=False)]
    # reshape would fill in a -1 (or take a bool): a shape says each dimension itself
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"shape {shape!r:.80} is not a list of dimensions >= 0")
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
