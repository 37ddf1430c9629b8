"""MessagePack codec for a rank's step payload: a MessagePack array of MicroBatch arrays.

Encoding is canonical (docs/wire-format.md): the bytes equal `msgpack.packb` of the same values as
plain lists, whether the micro-batches are encoded together or one at a time. It is
computed from the numpy arrays without Python lists of tokens: `wire_size` first, then one
buffer of exactly that size, filled in place (`encode_microbatches_into`). Peak memory is
the payload plus a few MiB of chunked temporaries, whatever the payload size.

The layout is a wire profile's (`transport.schema.WireProfile`: prime-rl 559b447 by default,
or 0f59b24); every function takes one.

Decoding reads homogeneous arrays (all floats, all bools, all ints, runs of equal strings)
straight into numpy, and any other shape of a field through msgpack's general reader, so
payloads from any canonical encoder (msgpack, msgspec) decode the same.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from transport._msgpack_arrays import readers, writers
from transport._msgpack_arrays.writers import array_header
from transport.schema import (
    ARRAY_DTYPES,
    WIRE_559B447,
    EncodedTensor,
    MicroBatch,
    RoutedExperts,
    SchemaError,
    WireProfile,
    as_encoded_tensors,
)

__all__ = [
    "CodecError",
    "array_elements",
    "array_header",
    "decode_microbatches",
    "encode_microbatch",
    "encode_microbatches",
    "encode_microbatches_into",
    "split_elements",
    "wire_size",
]


class CodecError(ValueError):
    """A payload that is not a well-formed MessagePack list of MicroBatch."""


_KIND = {name: dtype.kind for name, dtype in ARRAY_DTYPES.items()} | {"env_names": "str"}

# One micro-batch's env_names as runs of (encoded str, count): packers repeat one env name
# per sample, so a payload has a handful of runs, each written with doubling copies.
_Runs = list[tuple[bytes, int]]


def _env_name_runs(names: list[str], sample_lengths: np.ndarray) -> _Runs:
    """Runs of equal names, checked sample by sample (`list.count` compares by identity first,
    so a uniform sample costs about a nanosecond per token)."""
    encoded: dict[str, bytes] = {}
    runs: list[list[Any]] = []
    start = 0
    for length in sample_lengths.tolist():
        segment = names[start : start + length]
        start += length
        if not segment:
            continue
        if segment.count(segment[0]) == length:
            groups: Any = [(segment[0], length)]
        else:
            groups = ((name, sum(1 for _ in group)) for name, group in itertools.groupby(segment))
        for name, count in groups:
            if runs and runs[-1][0] == name:
                runs[-1][1] += count
            else:
                runs.append([name, count])
    for run in runs:
        if run[0] not in encoded:
            encoded[run[0]] = writers.encode_str(run[0])
    return [(encoded[name], count) for name, count in runs]


def _experts_parts(experts: RoutedExperts) -> list[bytes]:
    """routed_experts as [bin data, shape, dtype]: the small head and tail, and the data."""
    head = b"\x93" + writers.bin_header(len(experts.data))
    tail = msgpack.packb(list(experts.shape)) + msgpack.packb(experts.dtype)
    return [head, experts.data, tail]


def _mm_kwargs_parts(mm_kwargs: dict[str, EncodedTensor]) -> list[bytes]:
    """mm_kwargs as a map of name -> [dtype, shape, bin data], in the map's order: small
    encoded pieces and each tensor's raw bytes, to be written one after another."""
    parts = [writers.map_header(len(mm_kwargs))]
    for name, tensor in mm_kwargs.items():
        head = writers.encode_str(name) + b"\x93" + writers.encode_str(tensor.dtype)
        head += msgpack.packb(list(tensor.shape))
        parts += [head + writers.bin_header(len(tensor.data)), tensor.data]
    return parts


def _packed(value: Any) -> list[bytes]:
    """A small field (a few values per sequence or segment) as msgpack writes it."""
    return [msgpack.packb(value, use_bin_type=True)]


_PARTS: dict[str, Callable[[Any], list[bytes]]] = {
    "routed_experts": _experts_parts,
    "mm_kwargs": _mm_kwargs_parts,
    "mm_refs": _packed,
    "sampling_mask": lambda mask: _packed(list(mask)),
    "trace_ids": _packed,
    "branch_indices": _packed,
    "payload": lambda segments: _packed([segment.to_wire() for segment in segments]),
}


def _field_size(batch: MicroBatch, name: str, runs: _Runs) -> int:
    value = getattr(batch, name)
    if value is None:
        return 1
    if name in _PARTS:
        return sum(map(len, _PARTS[name](value)))
    size = len(array_header(len(value)))
    kind = _KIND[name]
    if kind == "str":
        return size + sum(len(encoded) * count for encoded, count in runs)
    if kind == "f":
        return size + 9 * len(value)
    if kind == "b":
        return size + len(value)
    return size + writers.int_body_size(value)


def _plan(batches: Sequence[MicroBatch], wire: WireProfile) -> tuple[int, list[_Runs]]:
    runs = [_env_name_runs(b.env_names, b.sequence_lengths) for b in batches]
    size = len(array_header(len(batches)))
    for batch, batch_runs in zip(batches, runs, strict=True):
        wire.refuse_uncarried(batch)
        size += len(array_header(len(wire.fields)))
        size += sum(_field_size(batch, name, batch_runs) for name in wire.fields)
    return size, runs


def wire_size(batches: Sequence[MicroBatch], wire: WireProfile = WIRE_559B447) -> int:
    """The exact number of bytes `encode_microbatches(batches, wire)` produces."""
    return _plan(batches, wire)[0]


_WRITERS: dict[str, Callable[[np.ndarray, np.ndarray, int], int]] = {
    "i": writers.write_ints,
    "f": writers.write_floats,
    "b": writers.write_bools,
}


def _write_microbatch(batch: MicroBatch, runs: _Runs, out: np.ndarray, pos: int, wire: WireProfile) -> int:
    """Fields strictly in wire order: an int field's last word store may spill up to 7
    bytes into the next field, which is then written over it."""
    pos = writers.put(out, pos, array_header(len(wire.fields)))
    for name in wire.fields:
        value = getattr(batch, name)
        if value is None:
            out[pos] = 0xC0
            pos += 1
        elif name in _PARTS:
            for part in _PARTS[name](value):
                out[pos : pos + len(part)] = np.frombuffer(part, np.uint8)
                pos += len(part)
        else:
            pos = writers.put(out, pos, array_header(len(value)))
            if name == "env_names":
                for encoded, count in runs:
                    pos = writers.write_repeated(encoded, count, out, pos)
            else:
                pos = _WRITERS[_KIND[name]](value, out, pos)
    return pos


def array_elements(name: str, values: np.ndarray) -> bytes:
    """The elements of a numeric field as they follow its array header on the wire.

    Canonical MessagePack writes each element on its own, so a field whose values are the
    concatenation of parts is its array header followed by each part's elements: the
    encoder can join parts made earlier (`tasks.stages.encode.assemble_rank`)."""
    kind = _KIND[name]
    size = 9 * len(values) if kind == "f" else len(values) if kind == "b" else writers.int_body_size(values)
    out = np.empty(size + 8, np.uint8)  # an int field's last word may spill up to 7 bytes
    end = _WRITERS[kind](np.asarray(values, ARRAY_DTYPES[name]), out, 0)
    if end != size:
        raise AssertionError(f"{name}: wrote {end} bytes of elements, planned {size}")
    return out[:size].tobytes()


def repeated_elements(name: str, value: Any, count: int) -> bytes:
    """`count` copies of one value's element of a field (a sample's advantage, temperature,
    env name over its tokens)."""
    return _one_element(name, value) * count


@functools.lru_cache(maxsize=4096)
def _one_element(name: str, value: Any) -> bytes:
    """One value's element (a step repeats its few advantages, temperatures and env names)."""
    return writers.encode_str(value) if _KIND[name] == "str" else array_elements(name, np.array([value]))


def join_microbatch(
    parts: Mapping[str, Sequence[bytes]],
    lengths: Sequence[int],
    wire: WireProfile = WIRE_559B447,
    values: Mapping[str, Any] | None = None,
) -> list[bytes]:
    """One micro-batch's encoding, in pieces, from the element parts of its per-token fields
    (`array_elements`, `repeated_elements`), its sample lengths, and the `values` of its
    small fields (trace ids, segments); every other field is absent. Joined with its
    micro-batches after `array_header(n)`, the bytes `encode_microbatches` writes for the
    same values."""
    values = values or {}
    for name in values:
        if not wire.carries(name):
            raise SchemaError(f"{name}: wire {wire.name} cannot carry it")
    tokens = sum(lengths)
    out = [array_header(len(wire.fields))]
    for name in wire.fields:
        if name in parts:
            out += [array_header(tokens), *parts[name]]
        elif name in ("sequence_lengths", "seq_lens"):
            out += [array_header(len(lengths)), array_elements(name, np.asarray(lengths, np.int64))]
        elif name in values:
            out += _PARTS[name](values[name])
        else:
            out.append(b"\xc0")
    return out


def split_elements(name: str, values: np.ndarray, lengths: Sequence[int]) -> list[bytes]:
    """`array_elements` of values that are parts of `lengths` concatenated, one bytes per
    part: many small parts encoded in one pass."""
    data = array_elements(name, values)
    kind = _KIND[name]
    if kind in "fb":
        ends = np.cumsum(lengths, dtype=np.int64) * (9 if kind == "f" else 1)
    else:
        sizes = np.cumsum(writers.int_element_sizes(np.asarray(values, np.int64)))
        counts = np.cumsum(lengths, dtype=np.int64)
        ends = np.where(counts > 0, sizes[np.maximum(counts - 1, 0)] if len(sizes) else 0, 0)
    starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
    return [data[int(a) : int(b)] for a, b in zip(starts, ends, strict=True)]


def encode_microbatches_into(
    batches: Sequence[MicroBatch], out: Any, size: int | None = None, wire: WireProfile = WIRE_559B447
) -> int:
    """Write the payload into the writable buffer `out` (at least `wire_size(batches)` bytes,
    or `size` when the caller has computed it); return the number of bytes written."""
    total, runs = _plan(batches, wire)
    if size is not None and size != total:
        raise ValueError(f"size {size} does not match the payload's wire size {total}")
    target = np.frombuffer(out, np.uint8, count=total)  # writes never pass `total`
    pos = writers.put(target, 0, array_header(len(batches)))
    for batch, batch_runs in zip(batches, runs, strict=True):
        pos = _write_microbatch(batch, batch_runs, target, pos, wire)
    if pos != total:
        raise AssertionError(f"wrote {pos} bytes, planned {total}")
    return total


def encode_microbatches(batches: Sequence[MicroBatch], wire: WireProfile = WIRE_559B447) -> memoryview:
    """A rank's payload in one buffer of exactly its wire size, as a read-write memoryview
    (hand it to Redis, ZMQ or a file without another copy; `bytes(...)` if you need bytes)."""
    total, runs = _plan(batches, wire)
    out = np.empty(total, np.uint8)
    pos = writers.put(out, 0, array_header(len(batches)))
    for batch, batch_runs in zip(batches, runs, strict=True):
        pos = _write_microbatch(batch, batch_runs, out, pos, wire)
    return memoryview(out)


def encode_microbatch(batch: MicroBatch, wire: WireProfile = WIRE_559B447) -> memoryview:
    """One micro-batch as a MessagePack array of its fields: `array_header(n)` followed by
    each micro-batch's encoding equals `encode_microbatches` of all n."""
    total, (runs,) = _plan([batch], wire)
    out = np.empty(total - 1, np.uint8)  # less the one-byte list header `_plan` counts
    _write_microbatch(batch, runs, out, 0, wire)
    return memoryview(out)


# --- decoding ------------------------------------------------------------------------------

_READERS: dict[str, Callable[[np.ndarray, int, int], tuple[Any, int]]] = {
    "i": readers.read_ints,
    "f": readers.read_floats,
    "b": readers.read_bools,
    "str": readers.read_repeated_strs,
}


def _read_array_header(buffer: np.ndarray, pos: int) -> tuple[int, int] | None:
    """Element count and body position of the array at `pos`, or None if no array header is there."""
    if pos >= len(buffer):
        return None
    tag = int(buffer[pos])
    if 0x90 <= tag <= 0x9F:
        return tag & 0x0F, pos + 1
    width = {0xDC: 2, 0xDD: 4}.get(tag)
    if width is None or pos + 1 + width > len(buffer):
        return None
    return int.from_bytes(buffer[pos + 1 : pos + 1 + width].tobytes(), "big"), pos + 1 + width


def _read_any(buffer: np.ndarray, pos: int, what: str) -> tuple[Any, int]:
    try:
        return readers.read_object(buffer, pos)
    except msgpack.OutOfData as exc:
        raise CodecError(f"{what}: payload truncated at byte {len(buffer)} (value starts at {pos})") from exc
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # TypeError: a map keyed by a map
        raise CodecError(f"{what}: malformed MessagePack at byte {pos}: {exc}") from exc


def _describe(buffer: np.ndarray, pos: int) -> str:
    """What kind of value is at `pos`, for error messages."""
    try:
        return type(readers.read_object(buffer, pos)[0]).__name__
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.OutOfData):
        return f"byte 0x{int(buffer[pos]):02x}" if pos < len(buffer) else "end of payload"


def _read_field(buffer: np.ndarray, pos: int, name: str) -> tuple[Any, int]:
    if pos < len(buffer) and buffer[pos] == 0xC0:
        return None, pos + 1
    reader = _READERS.get(_KIND.get(name, ""))
    header = _read_array_header(buffer, pos) if reader else None
    if reader and header:
        value, end = reader(buffer, header[1], header[0])
        if value is not None:
            return value, end
    value, end = _read_any(buffer, pos, name)
    if name == "routed_experts":
        if not isinstance(value, list) or len(value) != 3:
            raise SchemaError(f"routed_experts: expected [data, shape, dtype], got {value!r:.80}")
        value = RoutedExperts(data=value[0], shape=value[1], dtype=value[2])
    elif name == "mm_kwargs":
        value = as_encoded_tensors(value)
    return value, end


def decode_microbatches(
    data: bytes | bytearray | memoryview, wire: WireProfile = WIRE_559B447
) -> list[MicroBatch]:
    """Decode and validate a rank's payload; errors name the micro-batch and the field."""
    buffer = np.frombuffer(data, np.uint8)
    header = _read_array_header(buffer, 0)
    if header is None:
        raise CodecError(f"payload: expected an array of micro-batches, got {_describe(buffer, 0)}")
    count, pos = header
    batches = []
    for index in range(count):
        fields = _read_array_header(buffer, pos)
        if fields is None or fields[0] != len(wire.fields):
            got = _describe(buffer, pos) if fields is None else f"{fields[0]} elements"
            expected = f"{len(wire.fields)} fields ({wire.name})"
            raise CodecError(f"micro-batch {index}: expected an array of {expected}, got {got}")
        pos = fields[1]
        values = {}
        try:
            for name in wire.fields:
                values[name], pos = _read_field(buffer, pos, name)
            batches.append(MicroBatch(**values))
        except (CodecError, SchemaError) as exc:
            raise CodecError(f"micro-batch {index}: {exc}") from exc
    if pos != len(buffer):
        raise CodecError(f"payload: {len(buffer) - pos} unexpected bytes after the micro-batch list")
    return batches
