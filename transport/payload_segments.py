"""Per-token side arrays passed by handle: rows in files under a shared payload root.

A mixture-of-experts rollout's routed experts (one expert id per layer and top-k slot, per
token: 384 bytes a token for 48 layers x top-8) and sampling masks outweigh its tokens many
times over. A producer writes such rows to a file under the run's payload root and hands
rlship `PayloadSegment`s instead of arrays; Redis, the orchestrator and the cpu workers move
only the segments (about a hundred bytes each). finalize checks them against the files'
sizes, encode shifts them into micro-batch positions, and each trainer rank `pread`s the rows
of its micro-batches (`read_windows`). The layout is prime-rl's (`transports/payload.py` at its
commit 0f59b241): a segment is `rows` rows of `field` from token position `pos`, stored
C-contiguous as `[rows, *shape]` of `dtype` at byte `offset` of `file`.

Each segment also carries the checksum of its rows as the producer wrote them (`digest`, not
on the wire): a rank's checksum of the rows it read (`read_side_arrays`) is compared with the one
the encoder derives from the producers' (`digests_checksum`), as payload checksums are.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from transport.checksum import payload_checksum
from transport.run_files import foreign_write_problem, space_for

PAYLOAD_FIELD = "payload"
"""The name a rollout's segments travel under: beside its arrays, and as the micro-batch field."""


class SegmentReadError(OSError):
    """A segment whose rows cannot be read whole: its file is gone or shorter than it says."""


# A field names a wire field: no spaces (the producer's facts are words, the field one of them).
_SPACES = {"field": " without spaces", "file": "", "dtype": ""}


@dataclass(frozen=True, slots=True)
class PayloadSegment:
    """`rows` rows of `field` from token position `pos` (relative to the sequence that holds
    the segment: rollout, sample or micro-batch), at byte `offset` of `file`."""

    field: str
    file: str
    offset: int
    pos: int
    rows: int
    dtype: str
    shape: tuple[int, ...]
    digest: str = ""  # `payload_checksum` of the rows as written; "" once clipped
    # Rows rlship moved out of Redis for a field the trainers take inline: the encoder reads
    # them into the micro-batch (`--payload-store dir`). Neither travels on the wire.
    inline: bool = False

    @property
    def end(self) -> int:
        return self.pos + self.rows

    @property
    def row_bytes(self) -> int:
        return np.dtype(self.dtype).itemsize * math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def to_wire(self) -> list[Any]:
        """prime-rl's seven positional values (the digest stays with rlship)."""
        return [self.field, self.file, self.offset, self.pos, self.rows, self.dtype, list(self.shape)]

    def to_stored(self) -> list[Any]:
        return [*self.to_wire(), self.digest, self.inline]

    @classmethod
    def from_values(cls, values: Any, what: str = PAYLOAD_FIELD) -> PayloadSegment:
        """A segment from its wire (seven values) or stored (nine) form; ValueError naming
        `what` on anything else."""
        if not isinstance(values, list | tuple) or len(values) not in (7, 9):
            raise ValueError(
                f"{what}: expected [field, file, offset, pos, rows, dtype, shape], got {values!r:.80}"
            )
        field, file, offset, pos, rows, dtype, shape, *stored = values
        ints = {"offset": offset, "pos": pos, "rows": rows}
        for name, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{what}.{name}: {value!r} is not a non-negative int")
        if not isinstance(field, str) or not field or not isinstance(file, str) or not isinstance(dtype, str):
            raise ValueError(f"{what}: field, file and dtype must be non-empty strings, got {values!r:.80}")
        for name, text in {"field": field, "file": file, "dtype": dtype}.items():
            if not text.isprintable() or (name == "field" and " " in text):  # NUL, newline, surrogate
                raise ValueError(f"{what}.{name}: {text!r:.80} is not printable UTF-8 text{_SPACES[name]}")
        if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and d > 0 for d in shape):
            raise ValueError(f"{what}.shape: {shape!r} is not a list of positive ints")
        try:
            np.dtype(dtype)
        except (TypeError, ValueError, SyntaxError):  # numpy parses some dtype strings as Python
            raise ValueError(f"{what}.dtype: {dtype!r} is not a dtype numpy knows") from None
        digest, inline = stored or ("", False)
        if not isinstance(digest, str) or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{what}.digest: {digest!r:.80} is not a checksum (lowercase hex)")
        return cls(field, file, offset, pos, rows, dtype, tuple(shape), digest, bool(inline))


@dataclass(frozen=True)
class SideArrays:
    """Where a run's side arrays by handle may be: under `root` (any absolute path if
    None), and not at all if its wire cannot carry them (`refused_by` names that wire);
    `file_mode`: whose rows files are read (`transport.run_files.foreign_write_problem`)."""

    root: str | None = None
    refused_by: str | None = None
    file_mode: str = "owner"


ANYWHERE = SideArrays()
"""Side arrays by handle carried, from files anywhere (a producer or test without a run)."""


def clip_segments(segments: Iterable[PayloadSegment], lo: int, hi: int) -> list[PayloadSegment]:
    """The parts of `segments` inside positions [lo, hi), positions unchanged; a segment cut
    short loses its digest (its rows are no longer the ones the producer summed)."""
    out = []
    for segment in segments:
        start, end = max(segment.pos, lo), min(segment.end, hi)
        if start >= end:
            continue
        if (start, end) != (segment.pos, segment.end):
            offset = segment.offset + (start - segment.pos) * segment.row_bytes
            segment = replace(segment, offset=offset, pos=start, rows=end - start, digest="")
        out.append(segment)
    return out


def shift_segments(segments: Iterable[PayloadSegment], delta: int) -> list[PayloadSegment]:
    return [replace(segment, pos=segment.pos + delta) for segment in segments]


def segment_fields(segments: Iterable[PayloadSegment]) -> list[str]:
    return list(dict.fromkeys(segment.field for segment in segments))


def segments_problem(
    segments: Sequence[PayloadSegment], num_tokens: int, side_arrays: SideArrays
) -> str | None:
    """Why a rollout's segments cannot train (naming the field and the value), or None: each
    field's segments agree in dtype and row shape and cover every token exactly once, and
    each file is under the payload root (if the run has one), long enough and the run's."""
    by_field: dict[str, list[PayloadSegment]] = {}
    for segment in segments:
        by_field.setdefault(segment.field, []).append(segment)
    for field, field_segments in by_field.items():
        what = f"{PAYLOAD_FIELD}.{field}"
        first = field_segments[0]
        for segment in field_segments[1:]:
            if (segment.dtype, segment.shape) != (first.dtype, first.shape):
                return (
                    f"{what}: segments disagree on rows ({segment.dtype}{list(segment.shape)} after "
                    f"{first.dtype}{list(first.shape)})"
                )
        for segment in field_segments:
            if segment.end > num_tokens:
                return (
                    f"{what}: rows [{segment.pos}, {segment.end}) run past the rollout's {num_tokens} tokens"
                )
        if len(field_segments) == 1 and (first.pos, first.rows) == (0, num_tokens):
            continue  # one segment of every token: as producers mostly write them
        covered = np.zeros(num_tokens + 1, np.int32)
        for segment in field_segments:
            covered[segment.pos] += 1
            covered[segment.end] -= 1
        depth = np.cumsum(covered[:num_tokens])
        if num_tokens and (depth != 1).any():
            token = int(np.flatnonzero(depth != 1)[0])
            how = "no segment" if depth[token] == 0 else f"{int(depth[token])} segments"
            return f"{what}: token {token} is covered by {how} (each token needs exactly one row)"
    return _files_problem(segments, side_arrays)


def _files_problem(segments: Sequence[PayloadSegment], side_arrays: SideArrays) -> str | None:
    needed: dict[str, tuple[int, str]] = {}  # per file: the bytes its segments need, a field
    for segment in segments:
        most, field = needed.get(segment.file, (0, segment.field))
        needed[segment.file] = (max(most, segment.offset + segment.nbytes), field)
    for file, (size, field) in needed.items():
        problem = rows_file_problem(field, file, size, side_arrays)
        if problem is not None:
            return problem
    return None


def rows_file_problem(field: str, file: str, needed: int, side_arrays: SideArrays) -> str | None:
    """Why a file of `field`'s rows cannot be read as its segments say: not an absolute path,
    outside the payload root (if the run has one), gone, shorter than the `needed` bytes, or
    one another user could have written."""
    what = f"{PAYLOAD_FIELD}.{field}"
    root = side_arrays.root
    if "\0" in file:  # from a stream entry's facts: os.stat would raise ValueError
        return f"{what}: file {file!r} holds a NUL byte"
    if not os.path.isabs(file):
        return f"{what}: file {file!r} is not an absolute path"
    if root:
        base = _real_directory(root)
        directory, name = os.path.split(file)
        if os.path.commonpath([base, os.path.join(_real_directory(directory), name)]) != base:
            return f"{what}: file {file} is outside the payload root {root}"
    try:
        st = os.stat(file)
    except OSError as exc:
        return f"{what}: file {file} cannot be read ({exc.strerror})"
    if needed > st.st_size:
        return f"{what}: file {file} holds {st.st_size} bytes, its rows need {needed}"
    foreign = foreign_write_problem(file, st, side_arrays.file_mode)
    return None if foreign is None else f"{what}: file {foreign}"


@functools.lru_cache(maxsize=1024)
def _real_directory(path: str) -> str:
    """A directory's path with its links resolved, once per process: a step's thousands of
    files share a few directories. (A file's own name is not resolved: a link its producer
    put under the root counts as under it.)"""
    return os.path.realpath(path)


class SegmentReader:
    """Reads segments' rows with `pread`, one descriptor per file for the reader's life."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def read(self, segment: PayloadSegment) -> bytes:
        try:
            fd = self._fds.get(segment.file)
            if fd is None:
                fd = self._fds[segment.file] = os.open(segment.file, os.O_RDONLY)
            data = os.pread(fd, segment.nbytes, segment.offset)
        except OSError as exc:
            raise SegmentReadError(
                f"{PAYLOAD_FIELD}.{segment.field}: {segment.file}: {exc.strerror}"
            ) from exc
        except (ValueError, OverflowError) as exc:  # a NUL in the path, an offset no file has
            raise SegmentReadError(f"{PAYLOAD_FIELD}.{segment.field}: {segment.file!r}: {exc}") from exc
        if len(data) != segment.nbytes:
            raise SegmentReadError(
                f"{PAYLOAD_FIELD}.{segment.field}: short read from {segment.file} at byte {segment.offset}: "
                f"{len(data)} of {segment.nbytes} bytes"
            )
        return data


def read_windows(
    segments: Sequence[PayloadSegment], num_tokens: int, reader: SegmentReader
) -> dict[str, np.ndarray]:
    """Each field's rows over `num_tokens` positions (`[num_tokens, *shape]`, zeros where no
    segment covers a token), as a trainer builds them from its micro-batch's segments."""
    windows: dict[str, np.ndarray] = {}
    kinds: dict[str, tuple[str, tuple[int, ...]]] = {}
    for segment in segments:
        _check_kind(kinds, segment)
        window = windows.get(segment.field)
        if window is None:
            window = windows[segment.field] = np.zeros((num_tokens, *segment.shape), segment.dtype)
        rows = np.frombuffer(reader.read(segment), segment.dtype).reshape(segment.rows, *segment.shape)
        window[segment.pos : segment.end] = rows
    return windows


def _check_kind(kinds: dict[str, tuple[str, tuple[int, ...]]], segment: PayloadSegment) -> None:
    """A field's rows are of one dtype and row shape throughout (the first segment's)."""
    kind = (np.dtype(segment.dtype).name, segment.shape)
    first = kinds.setdefault(segment.field, kind)
    if kind != first:
        raise SegmentReadError(
            f"{PAYLOAD_FIELD}.{segment.field}: rows of {segment.dtype}{list(segment.shape)} after "
            f"{first[0]}{list(first[1])}"
        )


def read_side_arrays(batches: Sequence[Any]) -> str | None:
    """Read every side array a rank's micro-batches (rlship's or prime-rl's structs) point
    at, as a trainer rank does (each segment with `pread`), and check it: SegmentReadError if
    a file is gone or short, or a field's rows change kind or run past the micro-batch.
    Returns the checksum of the rows read (`digests_checksum`), None when there are no
    segments. The rows are checked where they are read, not copied into windows the
    reference rank would throw away."""
    digests: list[str] = []
    with SegmentReader() as reader:
        for batch in batches:
            kinds: dict[str, tuple[str, tuple[int, ...]]] = {}
            for segment in map(_as_segment, getattr(batch, PAYLOAD_FIELD, None) or ()):
                _check_kind(kinds, segment)
                if segment.end > len(batch.input_ids):
                    raise SegmentReadError(
                        f"{PAYLOAD_FIELD}.{segment.field}: rows [{segment.pos}, {segment.end}) run past "
                        f"the micro-batch's {len(batch.input_ids)} tokens"
                    )
                digests.append(payload_checksum(reader.read(segment)))
    return digests_checksum(digests) if digests else None


def _as_segment(segment: Any) -> PayloadSegment:
    """Ours, or prime-rl's struct of the same seven fields (what its decoder makes)."""
    if isinstance(segment, PayloadSegment):
        return segment
    names = ("field", "file", "offset", "pos", "rows", "dtype", "shape")
    return PayloadSegment.from_values([getattr(segment, name) for name in names])


def digests_checksum(digests: Iterable[str]) -> str:
    """One checksum of a payload's side-array rows, from its segments' own in payload order:
    what the encoder derives from the producers' digests, and a rank from what it read."""
    return payload_checksum("\n".join(digests).encode())


def rollout_rows_path(root: str | Path, run_id: str, rollout_id: str, inline: bool = False) -> Path:
    """Where a rollout's side-array rows live when rlship is to delete them with the
    rollout: one file per rollout in the run's own directory under the payload root (a file
    elsewhere is its producer's to delete), and one more for the rows rlship's producer kept
    out of Redis for fields the trainers take inline."""
    return Path(root) / run_id / (f"{rollout_id}.inline.rows" if inline else f"{rollout_id}.rows")


@dataclass(frozen=True)
class RunRows:
    """A run's own files of side-array rows, one per rollout (`rollout_rows_path`). rlship
    deletes a rollout's file when nothing can read it any more: discarded before a cut, or
    dropped at one, at once; shipped, when its step's payloads are released (a rank may
    replay them until then); whatever is left, when the run ends."""

    root: Path
    run_id: str

    @property
    def directory(self) -> Path:
        return Path(self.root) / self.run_id

    def exists(self) -> bool:
        return self.directory.is_dir()

    def unlink(self, rollout_ids: Iterable[str]) -> int:
        """Delete those rollouts' files (one that is gone already, or never was, is no error);
        returns how many went."""
        if not self.exists():
            return 0
        deleted = 0
        for rollout_id in rollout_ids:
            for inline in (False, True):
                try:
                    os.unlink(rollout_rows_path(self.root, self.run_id, rollout_id, inline))
                    deleted += 1
                except FileNotFoundError:
                    continue
        return deleted

    def remove_all(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def write_segment_file(
    path: Path, arrays: Mapping[str, np.ndarray], inline: bool = False
) -> list[PayloadSegment]:
    """Write a rollout's side arrays one after another to a new file at `path` and return
    their segments, each covering every token from position 0, with its digest. Written
    under a temporary name and linked into place, so a reader never sees half a file, and a
    file already there is kept: a rollout id given twice (which the run refuses) cannot
    change the rows the first one's segments point at. Its directory is made if missing; a
    disk without room for it raises `DiskFull`, leaving nothing behind."""
    segments = []
    offset = 0
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with space_for(path, sum(np.asarray(array).nbytes for array in arrays.values())):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(temporary, "wb") as out:
                for field, array in arrays.items():
                    data = np.ascontiguousarray(array)
                    out.write(data)
                    shape = tuple(int(d) for d in data.shape[1:])
                    digest = payload_checksum(data)
                    segments.append(
                        PayloadSegment(
                            field, str(path), offset, 0, len(data), data.dtype.name, shape, digest, inline
                        )
                    )
                    offset += data.nbytes
            with contextlib.suppress(FileExistsError):
                os.link(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    return segments
