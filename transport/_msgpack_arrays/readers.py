"""The reading half of `transport._msgpack_arrays`: int, float and bool arrays and runs of
repeated strings read from a uint8 buffer without a Python object per element, or None
where the values are not homogeneous (the caller then reads them with `read_object`)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from transport._msgpack_arrays import CHUNK, SMALL, overlapping_words

# The encoded size of an int by its first byte (0: not an int), and for the multi-byte
# tags 0xcc-0xd3 (index tag - 0xcc) the right shift of the big-endian 8-byte word after the tag.
_INT_SIZE_BY_BYTE = np.zeros(256, np.intp)
_INT_SIZE_BY_BYTE[:0x80] = 1
_INT_SIZE_BY_BYTE[0xE0:] = 1
_INT_SIZE_BY_BYTE[0xCC:0xD4] = [2, 3, 5, 9, 2, 3, 5, 9]
_READ_DTYPE = dict(
    zip(range(0xCC, 0xD4), (">u1", ">u2", ">u4", ">u8", ">i1", ">i2", ">i4", ">i8"), strict=True)
)
_READ_SHIFT = np.array([56, 48, 32, 0, 56, 48, 32, 0], np.uint64)


def read_ints(buffer: np.ndarray, pos: int, count: int) -> tuple[np.ndarray | None, int]:
    """Read `count` MessagePack ints at `buffer[pos:]` into an int64 array; (None, pos) if
    any element is not an int or is a uint64 above int64 max.

    Runs of one width class (sorted or small values: position ids, type ids) are read
    through strided views. Elsewhere element boundaries depend on every earlier tag, so
    they are found without a serial scan, a region of bytes at a time: a byte starts an
    element unless it lies inside a multi-byte int, whose tags are 0xcc-0xd3 (`_real_tags`).
    """
    if count < SMALL or count > len(buffer) - pos:  # an int takes a byte at least: not all there
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
    all fixints); (count, end), or None if the run is shorter than `SMALL` elements."""
    tag = int(buffer[pos]) if pos < len(buffer) else 0x80
    size = int(_INT_SIZE_BY_BYTE[tag])
    if not size:
        return None
    limit = min(len(out), (len(buffer) - pos) // size)
    count, window = 0, SMALL
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
    if count < SMALL:
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
        word = overlapping_words(region)[tags + 1].byteswap()
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


def read_floats(buffer: np.ndarray, pos: int, count: int) -> tuple[np.ndarray | None, int]:
    end = pos + 9 * count
    if end > len(buffer) or not np.all(buffer[pos:end:9] == 0xCB):
        return None, pos
    if not count:
        return np.empty(0, np.float64), end
    source = np.ndarray((count,), ">f8", buffer=buffer, offset=pos + 1, strides=(9,))
    return source.astype(np.float64), end


def read_bools(buffer: np.ndarray, pos: int, count: int) -> tuple[np.ndarray | None, int]:
    end = pos + count
    body = buffer[pos:end]
    if end > len(buffer) or not np.all((body | 1) == 0xC3):
        return None, pos
    return body == 0xC3, end


# --- strings, generic ---------------------------------------------------------------------------


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
