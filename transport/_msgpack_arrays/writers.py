"""The writing half of `transport._msgpack_arrays`: MessagePack headers, and the elements of
int, float and bool arrays and of repeated strings written in place into a uint8 buffer,
byte for byte what msgpack-python writes."""

from __future__ import annotations

import itertools

import msgpack
import numpy as np

from transport._msgpack_arrays import CHUNK, SMALL, overlapping_words

# Int width classes, the key `_int_keys` computes: 0-4 non-negative (fixint, uint8, uint16,
# uint32, uint64), 5-9 negative (fixint, int8, int16, int32, int64).
_POSITIVE_BOUNDS = (128, 1 << 8, 1 << 16, 1 << 32)
_NEGATIVE_BOUNDS = (-32, -(1 << 7), -(1 << 15), -(1 << 31))
_EXTRA_BYTES = (1, 1, 2, 4)  # crossing each bound: fixint 1 byte, then 2, 3, 5, 9
_SIZE = np.array([1, 2, 3, 5, 9, 1, 2, 3, 5, 9], np.intp)
_TAG = np.array([0, 0xCC, 0xCD, 0xCE, 0xCF, 0, 0xD0, 0xD1, 0xD2, 0xD3], np.uint8)
# An element of size s <= 5 is written as one little-endian 8-byte word whose first s bytes
# are its encoding: tag | byteswap(value & mask) >> shift (fixints: just the low byte).
_WORD_MASK = np.array([0xFF, 0xFF, 0xFFFF, 0xFFFF_FFFF, 0] * 2, np.uint64)
_WORD_SHIFT = np.array([56, 48, 40, 24, 0] * 2, np.uint64)
_WORD_TAG = _TAG.astype(np.uint64)
# Big-endian value dtype of each multi-byte class, for single-class strided writes.
_VALUE_DTYPE = {1: ">u1", 2: ">u2", 3: ">u4", 4: ">u8", 6: ">i1", 7: ">i2", 8: ">i4", 9: ">i8"}
_FEW_RUNS = 16
"""A mixed chunk with fewer runs of one width class than this is written run by run."""


def _length_header(length: int, tag8: bytes | None, tag16: bytes, tag32: bytes) -> bytes:
    """The smallest of a type's length forms: 8-bit (where it has one, `tag8`), 16-bit, 32-bit."""
    if tag8 is not None and length < 1 << 8:
        return tag8 + bytes([length])
    if length < 1 << 16:
        return tag16 + length.to_bytes(2, "big")
    return tag32 + length.to_bytes(4, "big")


def array_header(length: int) -> bytes:
    """The smallest MessagePack array header for `length` elements."""
    return bytes([0x90 | length]) if length < 16 else _length_header(length, None, b"\xdc", b"\xdd")


def map_header(length: int) -> bytes:
    """The smallest MessagePack map header for `length` entries."""
    return bytes([0x80 | length]) if length < 16 else _length_header(length, None, b"\xde", b"\xdf")


def str_header(length: int) -> bytes:
    """The str header msgpack-python writes with use_bin_type=True (fixstr, str8, str16, str32)."""
    return bytes([0xA0 | length]) if length < 32 else _length_header(length, b"\xd9", b"\xda", b"\xdb")


def bin_header(length: int) -> bytes:
    """The smallest bin header (bin8, bin16, bin32)."""
    return _length_header(length, b"\xc4", b"\xc5", b"\xc6")


def encode_str(value: str) -> bytes:
    data = value.encode("utf-8")
    return str_header(len(data)) + data


def put(out: np.ndarray, pos: int, data: bytes) -> int:
    """Copy small encoded bytes (headers, scalars) into `out` at `pos`; return the new position."""
    end = pos + len(data)
    out[pos:end] = np.frombuffer(data, np.uint8)
    return end


# --- ints ----------------------------------------------------------------------------------


def _int_key(value: int) -> int:
    """The width class of one int (the scalar version of `_int_keys`)."""
    if value >= 0:
        return sum(value >= bound for bound in _POSITIVE_BOUNDS)
    return 5 + sum(value < bound for bound in _NEGATIVE_BOUNDS)


def _int_keys(values: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The width class of each element; comparisons that `lo`/`hi` rule out are skipped."""
    keys = np.zeros(len(values), np.intp)
    for bound in _POSITIVE_BOUNDS:
        if hi >= bound:
            keys += values >= bound
    if lo < 0:
        keys += (values < 0) * 5
        for bound in _NEGATIVE_BOUNDS:
            if lo < bound:
                keys += values < bound
    return keys


def int_element_sizes(values: np.ndarray) -> np.ndarray:
    """The encoded size of each element of an int64 array."""
    if not len(values):
        return np.zeros(0, np.intp)
    return _SIZE.take(_int_keys(values, int(values.min()), int(values.max())))


def int_body_size(values: np.ndarray) -> int:
    """Bytes of the elements of an int64 array (without the array header): one byte each,
    plus what each width bound that an element crosses adds."""
    total = len(values)
    for start in range(0, len(values), CHUNK):
        chunk = values[start : start + CHUNK]
        lo, hi = int(chunk.min()), int(chunk.max())
        for bound, extra in zip(_POSITIVE_BOUNDS, _EXTRA_BYTES, strict=True):
            if hi >= bound:
                total += extra * int(np.count_nonzero(chunk >= bound))
        for bound, extra in zip(_NEGATIVE_BOUNDS, _EXTRA_BYTES, strict=True):
            if lo < bound:
                total += extra * int(np.count_nonzero(chunk < bound))
    return total


def write_ints(values: np.ndarray, out: np.ndarray, pos: int) -> int:
    """Write the elements of an int64 array at `out[pos:]`; return the end position.

    Each chunk is either one width class (a strided tag fill and a strided big-endian copy)
    or mixed: every element is stored as one unaligned 8-byte word at its offset, in
    increasing offset order, so each word's surplus bytes are overwritten by the next
    element (or by the field written after this one). This relies on numpy assigning
    through a 1-D integer index in index order, which the byte-identity tests pin down.
    9-byte elements (beyond 32 bits) get their tag and a second word afterwards; the last
    elements of the buffer, where a word would not fit, are written byte by byte.
    """
    if len(values) < SMALL:
        return put(out, pos, msgpack.packb(values.tolist())[len(array_header(len(values))) :])
    words = overlapping_words(out)
    for start in range(0, len(values), CHUNK):
        chunk = values[start : start + CHUNK]
        lo, hi = int(chunk.min()), int(chunk.max())
        key = _int_key(lo)
        if key == _int_key(hi):
            pos = _write_one_class(chunk, key, out, pos)
            continue
        keys = _int_keys(chunk, lo, hi)
        bounds = _class_runs(keys)
        if bounds:  # sorted values: a few runs of one class each
            for run_start, run_end in itertools.pairwise(bounds):
                pos = _write_one_class(chunk[run_start:run_end], int(keys[run_start]), out, pos)
            continue
        sizes = _SIZE.take(keys)
        ends = np.cumsum(sizes)
        ends += pos
        offsets = ends - sizes
        word = chunk.view(np.uint64) & _WORD_MASK.take(keys)
        word.byteswap(inplace=True)
        word >>= _WORD_SHIFT.take(keys)
        word |= _WORD_TAG.take(keys)
        fits = len(offsets)
        if int(offsets[-1]) > len(out) - 8:
            fits = int(np.searchsorted(offsets, len(out) - 8, "right"))
        words[offsets[:fits]] = word[:fits]
        if hi >= 1 << 32 or lo < -(1 << 31):
            wide = np.flatnonzero(sizes[:fits] == 9)
            out[offsets[wide]] = _TAG.take(keys[wide])
            words[offsets[wide] + 1] = chunk[wide].view(np.uint64).byteswap()
        for index in range(fits, len(chunk)):
            put(out, int(offsets[index]), msgpack.packb(int(chunk[index])))
        pos = int(ends[-1])
    return pos


def _class_runs(keys: np.ndarray) -> list[int] | None:
    """Boundaries of the runs of one width class, or None if there are `_FEW_RUNS` or more
    (a look at a prefix first, so that unsorted values cost little)."""
    head = keys[: 4 * _FEW_RUNS]
    if np.count_nonzero(head[1:] != head[:-1]) >= _FEW_RUNS:
        return None
    changes = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    return None if len(changes) >= _FEW_RUNS else [0, *changes.tolist(), len(keys)]


def _write_one_class(chunk: np.ndarray, key: int, out: np.ndarray, pos: int) -> int:
    size = int(_SIZE[key])
    end = pos + size * len(chunk)
    if size == 1:
        np.copyto(out[pos:end], chunk, casting="unsafe")
        return end
    out[pos:end:size] = _TAG[key]
    target = np.ndarray((len(chunk),), _VALUE_DTYPE[key], buffer=out, offset=pos + 1, strides=(size,))
    np.copyto(target, chunk, casting="unsafe")
    return end


# --- floats, bools --------------------------------------------------------------------------


def write_floats(values: np.ndarray, out: np.ndarray, pos: int) -> int:
    """float64 elements: tag 0xcb and the big-endian value, through a stride-9 view."""
    end = pos + 9 * len(values)
    if not len(values):
        return end
    out[pos:end:9] = 0xCB
    target = np.ndarray((len(values),), ">f8", buffer=out, offset=pos + 1, strides=(9,))
    np.copyto(target, values)
    return end


def write_bools(values: np.ndarray, out: np.ndarray, pos: int) -> int:
    end = pos + len(values)
    np.add(values.view(np.uint8), 0xC2, out=out[pos:end])
    return end


# --- strings ---------------------------------------------------------------------------------


def write_repeated(encoded: bytes, count: int, out: np.ndarray, pos: int) -> int:
    """`count` copies of `encoded`, by doubling memcpys."""
    total = len(encoded) * count
    if not total:
        return pos
    put(out, pos, encoded)
    done = len(encoded)
    while done < total:
        step = min(done, total - done)
        out[pos + done : pos + done + step] = out[pos : pos + step]
        done += step
    return pos + total
