"""Vectorised MessagePack for one-dimensional numpy arrays, written into and read from a byte buffer.

The writers produce exactly the bytes `msgpack.packb(array.tolist(), use_bin_type=True)` would,
straight from the array, in place in a preallocated uint8 buffer: no Python objects per
element and only bounded temporaries (ints are processed in chunks of `CHUNK` elements).
The readers do the inverse for the homogeneous cases (all floats, all bools, all ints,
repeated strings) and return None for anything else, so the caller can fall back to a
general MessagePack reader for that value.

Variable-width ints are the hard part in both directions; see `write_ints` and `read_ints`.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgpack
import numpy as np

CHUNK = 1 << 15
"""Elements per vectorised step: temporaries stay around 2 MiB whatever the payload."""

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

# Decoding: encoded size of an int by its first byte (0: not an int), and for the multi-byte
# tags 0xcc-0xd3 (index tag - 0xcc) the right shift of the big-endian 8-byte word after the tag.
_INT_SIZE_BY_BYTE = np.zeros(256, np.intp)
_INT_SIZE_BY_BYTE[:0x80] = 1
_INT_SIZE_BY_BYTE[0xE0:] = 1
_INT_SIZE_BY_BYTE[0xCC:0xD4] = [2, 3, 5, 9, 2, 3, 5, 9]
_READ_DTYPE = dict(
    zip(range(0xCC, 0xD4), (">u1", ">u2", ">u4", ">u8", ">i1", ">i2", ">i4", ">i8"), strict=True)
)
_READ_SHIFT = np.array([56, 48, 32, 0, 56, 48, 32, 0], np.uint64)
_SMALL = 64
"""Int arrays shorter than this go through msgpack: vectorising costs more than it saves."""
_FEW_RUNS = 16
"""A mixed chunk with fewer runs of one width class than this is written run by run."""


def _container_header(length: int, fix: int, tag16: bytes, tag32: bytes) -> bytes:
    if length < 16:
        return bytes([fix | length])
    if length < 1 << 16:
        return tag16 + length.to_bytes(2, "big")
    return tag32 + length.to_bytes(4, "big")


def array_header(length: int) -> bytes:
    """The smallest MessagePack array header for `length` elements."""
    return _container_header(length, 0x90, b"\xdc", b"\xdd")


def map_header(length: int) -> bytes:
    """The smallest MessagePack map header for `length` entries."""
    return _container_header(length, 0x80, b"\xde", b"\xdf")


def str_header(length: int) -> bytes:
    """The str header msgpack-python writes with use_bin_type=True (fixstr, str8, str16, str32)."""
    if length < 32:
        return bytes([0xA0 | length])
    if length < 1 << 8:
        return bytes([0xD9, length])
    if length < 1 << 16:
        return b"\xda" + length.to_bytes(2, "big")
    return b"\xdb" + length.to_bytes(4, "big")


def bin_header(length: int) -> bytes:
    """The smallest bin header (bin8, bin16, bin32)."""
    if length < 1 << 8:
        return bytes([0xC4, length])
    if length < 1 << 16:
        return b"\xc5" + length.to_bytes(2, "big")
    return b"\xc6" + length.to_bytes(4, "big")


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


def _overlapping_words(buffer: np.ndarray) -> np.ndarray:
    """Native uint64 words starting at every byte of `buffer` (stride 1): one unaligned
    8-byte load or store per element instead of one per byte."""
    return np.ndarray((max(len(buffer) - 7, 0),), np.uint64, buffer=buffer, strides=(1,))


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
    if len(values) < _SMALL:
        return put(out, pos, msgpack.packb(values.tolist())[len(array_header(len(values))) :])
    words = _overlapping_words(out)
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


def read_ints(buffer: np.ndarray, pos: int, count: int) -> tuple[np.ndarray | None, int]:
    """Read `count` MessagePack ints at `buffer[pos:]` into an int64 array; (None, pos) if
    any element is not an int or is a uint64 above int64 max.

    Runs of one width class (sorted or small values: position ids, type ids) are read
    through strided views. Elsewhere element boundaries depend on every earlier tag, so
    they are found without a serial scan, a region of bytes at a time: a byte starts an
    element unless it lies inside a multi-byte int, whose tags are 0xcc-0xd3 (`_real_tags`).
    """
    if count < _SMALL:
        return None, pos
    result = np.empty(count, np.int64)
    done = 0
    bytes_per_int = 1.0  # the region size adapts to the bytes per element seen so far
    while done < count:
        remaining = count - done
        run = _read_one_class(buffer, pos, result[done:])
        if run:
            done += run[0]
            pos = run[1]
            continue
        span = min(9 * remaining, 9 * CHUNK, int((bytes_per_int + 0.25) * remaining) + 64, len(buffer) - pos)
        region = buffer[pos : pos + span + 8]
        if len(region) < span + 8:  # the payload's last bytes: pad so that every word load fits
            region = np.concatenate([region, np.zeros(span + 8 - len(region), np.uint8)])
        parsed = _read_int_chunk(region, span, remaining) if span > 0 else None
        if parsed is None:
            return None, pos
        values, used = parsed
        result[done : done + len(values)] = values
        done += len(values)
        pos += used
        bytes_per_int = used / len(values)
    return result, pos


def _read_one_class(buffer: np.ndarray, pos: int, out: np.ndarray) -> tuple[int, int] | None:
    """Decode into `out` the run of ints at `pos` that share the first one's tag (or are
    all fixints); (count, end), or None if the run is shorter than `_SMALL` elements."""
    tag = int(buffer[pos]) if pos < len(buffer) else 0x80
    size = int(_INT_SIZE_BY_BYTE[tag])
    if not size:
        return None
    limit = min(len(out), (len(buffer) - pos) // size)
    count, window = 0, _SMALL
    while count < limit:
        take = min(window, limit - count)
        start = pos + count * size
        heads = buffer[start : start + take * size : size]
        bad = (heads - 0x80) < 0x60 if size == 1 else heads != tag
        first_bad = int(bad.argmax())
        if bad[first_bad]:
            count += first_bad
            break
        count += take
        window = min(2 * window, CHUNK)
    if count < _SMALL:
        return None
    if size == 1:
        np.copyto(out[:count], buffer[pos : pos + count].view(np.int8))
    else:
        source = np.ndarray((count,), _READ_DTYPE[tag], buffer=buffer, offset=pos + 1, strides=(size,))
        if tag == 0xCF and int(source.max()) > (1 << 63) - 1:
            return None
        np.copyto(out[:count], source, casting="unsafe")
    return count, pos + count * size


def _read_int_chunk(region: np.ndarray, span: int, limit: int) -> tuple[np.ndarray, int] | None:
    """Up to `limit` complete ints from the first `span` bytes of `region` (which has 8
    readable bytes past `span`) and the bytes they use; None if one is not an int."""
    body = region[:span]
    tags = np.flatnonzero((body - 0xCC) <= 7)
    kinds = body[tags] - 0xCC
    tag_ends = tags + _INT_SIZE_BY_BYTE.take(kinds + 0xCC)
    real = _real_tags(tags, tag_ends)
    tags, tag_ends, kinds = tags[real], tag_ends[real], kinds[real]
    if len(tags) and tag_ends[-1] > span:  # the region cuts the last int: leave it for the next
        tags, tag_ends, kinds, used = tags[:-1], tag_ends[:-1], kinds[:-1], int(tags[-1])
    else:
        used = span
    extra = tag_ends - tags - 1
    covered = np.cumsum(extra)
    tag_index = tags - covered + extra  # element index: offset less the bytes covered before it
    count = used - (int(covered[-1]) if len(covered) else 0)
    if count > limit:
        keep = int(np.searchsorted(tag_index, limit))
        tags, tag_index, extra, kinds = tags[:keep], tag_index[:keep], extra[:keep], kinds[:keep]
        count = limit
    if count == 0:
        return None
    skips = np.zeros(count + 1, np.intp)
    skips[tag_index + 1] = extra
    starts = np.cumsum(skips[:count])
    starts += np.arange(count)
    first = body[starts]
    # Every start that is not a real tag must be a fixint (0x00-0x7f, 0xe0-0xff).
    if np.count_nonzero((first - 0x80) < 0x60) != len(tags):
        return None
    values = first.view(np.int8).astype(np.int64)
    if len(tags):
        word = _overlapping_words(region)[tags + 1].byteswap()
        wide = kinds == 3
        if wide.any() and np.any(word[wide] >> np.uint64(63)):
            return None
        shifts = _READ_SHIFT.take(kinds)
        decoded = (word >> shifts).view(np.int64)
        signed = kinds >= 4
        if signed.any():
            decoded[signed] = word[signed].view(np.int64) >> shifts[signed].view(np.int64)
        values[tag_index] = decoded
    return values, int(starts[-1]) + int(skips[count]) + 1


def _real_tags(tags: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Which tag-like bytes (offsets `tags`, element ends `ends`) are real tags.

    A tag is real iff no earlier real tag covers it; equivalently the real tags are the
    path from the first one through "the next tag-like byte at or after my end". Tags no
    tag-like byte covers are certainly real (usually over 90%). The rest, the doubtful
    ones, lie in short stretches (long ones where data bytes look like tags, as in
    sequential values 0xcfXX), each entered from the last certain tag before it; the path
    through them is followed for all stretches at once by pointer doubling.
    """
    if not len(tags):
        return np.zeros(0, bool)
    real = _previous_max(ends) <= tags  # the first tag is always certain
    doubtful = np.flatnonzero(~real)
    if not len(doubtful):
        return real
    certain = np.flatnonzero(real)
    entries = certain[np.searchsorted(certain, doubtful) - 1]  # sorted: drop repeats
    entries = entries[np.diff(entries, prepend=-1) != 0]
    nodes = np.sort(np.concatenate([entries, doubtful]))
    successor = nodes + 1
    node_ends = ends[nodes]
    last = len(tags) - 1
    for shift in range(1, 9):  # at most 8 tag-like bytes lie inside a tag's span
        inside = tags.take(nodes + shift, mode="clip") < node_ends
        if nodes[-1] + shift > last:
            inside &= nodes + shift <= last
        if not inside.any():
            break
        successor += inside
    # Local successor within `nodes`; a certain tag (or the region's end) ends the stretch.
    exit_node = len(nodes)
    leaves = real.take(successor, mode="clip") | (successor > last)
    local = np.where(leaves, exit_node, np.searchsorted(nodes, successor))
    on_path = _reachable(local, np.searchsorted(nodes, entries))
    real[nodes[on_path]] = True
    return real


def _reachable(successor: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """Mask of the nodes on the paths from `sources` along `successor` (successor[i] > i;
    len(successor) is the exit), by pointer doubling: O(n log(path length))."""
    exit_node = len(successor)
    jumps = [np.append(successor, exit_node)]  # jumps[k][i]: 2**k steps from i
    while np.any(jumps[-1][sources] < exit_node):
        jumps.append(jumps[-1][jumps[-1]])
    path = sources  # the nodes 0, 2**k, 2 * 2**k, ... steps from the sources
    for jump in reversed(jumps[:-1]):
        both = np.concatenate([path, jump[path]])
        path = both[both < exit_node]
    on_path = np.zeros(exit_node, bool)
    on_path[path] = True
    return on_path


def _previous_max(values: np.ndarray) -> np.ndarray:
    """The maximum of the elements before each element (0 for the first)."""
    result = np.empty_like(values)
    result[0] = 0
    np.maximum.accumulate(values[:-1], out=result[1:])
    return result


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


def read_floats(buffer: np.ndarray, pos: int, count: int) -> tuple[np.ndarray | None, int]:
    end = pos + 9 * count
    if end > len(buffer) or not np.all(buffer[pos:end:9] == 0xCB):
        return None, pos
    if not count:
        return np.empty(0, np.float64), end
    source = np.ndarray((count,), ">f8", buffer=buffer, offset=pos + 1, strides=(9,))
    return source.astype(np.float64), end


def write_bools(values: np.ndarray, out: np.ndarray, pos: int) -> int:
    end = pos + len(values)
    np.add(values.view(np.uint8), 0xC2, out=out[pos:end])
    return end


def read_bools(buffer: np.ndarray, pos: int, count: int) -> tuple[np.ndarray | None, int]:
    end = pos + count
    body = buffer[pos:end]
    if end > len(buffer) or not np.all((body | 1) == 0xC3):
        return None, pos
    return body == 0xC3, end


# --- strings, generic ---------------------------------------------------------------------------


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


def _str_span(buffer: np.ndarray, pos: int) -> tuple[int, int] | None:
    """Header and payload length of the str at `pos`, or None if it is not a str."""
    if pos >= len(buffer):
        return None
    tag = int(buffer[pos])
    if 0xA0 <= tag <= 0xBF:
        return 1, tag & 0x1F
    width = {0xD9: 1, 0xDA: 2, 0xDB: 4}.get(tag)
    if width is None or pos + 1 + width > len(buffer):
        return None
    return 1 + width, int.from_bytes(buffer[pos + 1 : pos + 1 + width].tobytes(), "big")


def read_repeated_strs(buffer: np.ndarray, pos: int, count: int) -> tuple[list[str] | None, int]:
    """`count` strs as a list that shares one str object per run of equal strings.

    Runs are found by comparing the bytes ahead with the run's first encoding, in
    doubling windows; (None, pos) when an element is not a str, or when runs are so short
    (under 4 elements on average) that a general reader is faster.
    """
    strings: list[str] = []
    decoded: dict[bytes, str] = {}
    runs = 0
    start = pos
    while len(strings) < count:
        span = _str_span(buffer, pos)
        if span is None or pos + sum(span) > len(buffer):
            return None, start
        encoded = buffer[pos : pos + sum(span)]
        key = encoded.tobytes()
        text = decoded.get(key)
        if text is None:
            try:
                text = decoded[key] = key[span[0] :].decode("utf-8")
            except UnicodeDecodeError:
                return None, start
        length = _run_length(buffer, pos, encoded, count - len(strings))
        strings.extend([text] * length)
        pos += length * len(encoded)
        runs += 1
        if runs > 16 and 4 * runs > len(strings):
            return None, start
    return strings, pos


def _run_length(buffer: np.ndarray, pos: int, encoded: np.ndarray, limit: int) -> int:
    """How many copies of `encoded` start at `pos` back to back (at least 1, at most `limit`)."""
    size = len(encoded)
    limit = min(limit, (len(buffer) - pos) // size)
    reps = max(1, min(limit, (1 << 18) // size))
    pattern = np.tile(encoded, reps)
    found = 1
    window = 64
    while found < limit:
        take = min(window, limit - found, reps)
        base = pos + found * size
        differs = buffer[base : base + take * size] != pattern[: take * size]
        first = int(differs.argmax())
        if differs[first]:
            return found + first // size
        found += take
        window *= 2
    return found


class _Source:
    """A file-like view of `buffer[pos:]` for msgpack.Unpacker (no copy of the whole payload)."""

    def __init__(self, buffer: np.ndarray, pos: int) -> None:
        self._view = memoryview(buffer)
        self._pos = pos

    def read(self, size: int) -> bytes:
        chunk = self._view[self._pos : self._pos + size]
        self._pos += len(chunk)
        return bytes(chunk)


def read_object(buffer: np.ndarray, pos: int) -> tuple[Any, int]:
    """One MessagePack value of any shape at `pos` (the general path); raises
    msgpack.OutOfData if the payload ends inside it."""
    limit = max(len(buffer), 1 << 16)
    unpacker = msgpack.Unpacker(
        _Source(buffer, pos), raw=False, strict_map_key=False, max_buffer_size=limit, read_size=1 << 16
    )
    value = unpacker.unpack()
    return value, pos + unpacker.tell()
