"""A test-side decoder of prime-rl's trainer wire as of commit 0f59b24, and its payload reads.

What it models (prime-rl commit 0f59b241f0471ad1df310ecccfd326313ac0d460):

- the micro-batch a trainer rank decodes from every step's message or file
  (src/prime_rl/transports/batch/types.py: ``MicroBatch``, a msgspec struct with
  ``array_like=True, omit_defaults=True`` and 20 positional fields). Decoding, msgspec
  gives the fields missing from the end of a shorter array their defaults (an older
  16-field sender's arrays decode, ``sampling_mask``, ``trace_ids``, ``branch_indices`` and
  ``payload`` None) and skips extra elements at the end of a longer one. Encoding,
  ``omit_defaults`` has no effect on an ``array_like`` struct (msgspec issue #720, still so
  in msgspec 0.23): prime-rl's own sender writes all 20 elements, unset ones as nil;
- the per-token side arrays passed by handle (src/prime_rl/transports/payload.py:
  ``PayloadSegment``): ``rows`` rows of ``field`` starting at micro-batch position ``pos``,
  stored C-contiguous as a ``[rows, *shape]`` ``dtype`` array at byte ``offset`` of ``file``;
- how a trainer rank reads them (src/prime_rl/trainer/rl/data.py, ``DataLoader._read_payload``
  calling payload.py's ``read_field``): for a window ``[lo, hi)`` of positions it clips the
  field's segments to the window, ``os.pread``s each clipped segment's bytes, casts them into
  a ``[hi - lo, *width]`` array (``width`` the elementwise max of the field's row shapes,
  narrower rows filling the leading entries, positions no segment covers left at the fill,
  later segments winning) and fails on a short read; a missing file fails on open.

It is written from reading prime-rl's public source, on purpose independently of rlship's
own schema and codec (nothing here imports rlship's ``transport``, ``tasks`` or
``orchestrator`` packages), so that a test decoding rlship's output with it checks rlship's
encoder against what prime-rl's trainers decode rather than against itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np
from numpy.typing import DTypeLike

WIRE = "prime-rl-0f59b24"
COMMIT = "0f59b241f0471ad1df310ecccfd326313ac0d460"

# The value a trainer rank leaves where no segment covers a position (data.py's _read_payload).
FILLS: dict[str, int] = {"routed_experts": 0, "sampling_mask": -1}


class PayloadReadError(RuntimeError):
    """A payload segment's rows could not be read: its file is missing or too short."""


class PayloadSegment(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """``rows`` rows of ``field`` from position ``pos``: a C-contiguous ``[rows, *shape]``
    ``dtype`` array at byte ``offset`` of ``file``."""

    field: str
    file: str
    offset: int
    pos: int
    rows: int
    dtype: str
    shape: list[int]


class MMImageRef(msgspec.Struct, array_like=True, gc=False):
    url: str
    offset: int
    length: int


class MMRefs(msgspec.Struct, array_like=True, gc=False):
    images: list[MMImageRef]


class RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]  # [seq_len, layers, topk]
    dtype: str


class SamplingMask(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    ids: bytes  # flat int32 token ids
    counts: bytes  # int32 per position, len(ids) == 4 * sum(counts)


class MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One micro-batch as a 0f59b24 trainer rank decodes it (20 positional fields)."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_refs: MMRefs | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    sampling_mask: SamplingMask | None = None
    trace_ids: list[str] | None = None  # parallel to sequence_lengths; "" marks padding
    branch_indices: list[int] | None = None  # parallel to sequence_lengths; -1 marks padding
    payload: list[PayloadSegment] | None = None  # positions relative to input_ids


_DECODER = msgspec.msgpack.Decoder(type=list[MicroBatch])
_ENCODER = msgspec.msgpack.Encoder()


def decode_payload(data: bytes | bytearray | memoryview) -> list[MicroBatch]:
    """A step's message (or rank file) as a trainer rank's receiver decodes it."""
    return _DECODER.decode(data)


def encode_payload(batches: Sequence[MicroBatch]) -> bytes:
    """A step's message as prime-rl's own sender encodes it (msgspec's default encoder)."""
    return _ENCODER.encode(list(batches))


def _row_bytes(segment: PayloadSegment) -> int:
    return np.dtype(segment.dtype).itemsize * math.prod(segment.shape)


def read_window(
    segments: Iterable[PayloadSegment],
    field: str,
    lo: int,
    hi: int,
    dtype: DTypeLike,
    *,
    fill: int | float = 0,
) -> np.ndarray | None:
    """Positions ``[lo, hi)`` of ``field`` as a ``[hi - lo, *width]`` ``dtype`` array, read
    with ``os.pread`` as a trainer rank reads its window; None when no segment carries
    ``field``. ``width`` is the elementwise max of the field's row shapes (narrower rows fill
    the leading entries); positions no segment covers hold ``fill``; later segments win.
    Raises PayloadReadError, naming the file and byte offset, on a missing file or a short
    read, and ValueError when the field's segments disagree on the number of row dimensions."""
    mine = [segment for segment in segments if segment.field == field]
    if not mine:
        return None
    if len({len(segment.shape) for segment in mine}) != 1:
        raise ValueError(f"segments of {field!r} disagree on their row dimensions: {mine}")
    width = [max(dims) for dims in zip(*(segment.shape for segment in mine), strict=True)]
    out_dtype = np.dtype(dtype)
    out = np.full((max(hi - lo, 0), *width), np.asarray(fill).astype(out_dtype), dtype=out_dtype)
    descriptors: dict[str, int] = {}
    try:
        for segment in mine:
            start, end = max(segment.pos, lo), min(segment.pos + segment.rows, hi)
            if start >= end:
                continue
            row_bytes = _row_bytes(segment)
            offset = segment.offset + (start - segment.pos) * row_bytes
            wanted = (end - start) * row_bytes
            descriptor = descriptors.get(segment.file)
            if descriptor is None:
                try:
                    descriptor = descriptors[segment.file] = os.open(segment.file, os.O_RDONLY)
                except OSError as error:
                    raise PayloadReadError(
                        f"payload file {segment.file} cannot be opened to read {field!r} at offset "
                        f"{offset}: {error.strerror or error}"
                    ) from error
            data = os.pread(descriptor, wanted, offset)
            if len(data) != wanted:
                raise PayloadReadError(
                    f"short payload read from {segment.file} at offset {offset}: {len(data)} of "
                    f"{wanted} bytes of {field!r} (positions {start}..{end}, segment {segment})"
                )
            rows = np.frombuffer(data, dtype=segment.dtype).reshape(end - start, *segment.shape)
            out[(slice(start - lo, end - lo), *(slice(0, dim) for dim in segment.shape))] = rows
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)
    return out


def payload_fields(batch: MicroBatch) -> list[str]:
    """The fields the micro-batch carries by handle, sorted."""
    return sorted({segment.field for segment in batch.payload or ()})


def sequence_rows(batch: MicroBatch, field: str) -> dict[str, bytes]:
    """Per sequence of the micro-batch (``sequence_lengths``, named by ``trace_ids``; a ""
    trace id is padding and skipped), the raw bytes of ``field``'s rows at that sequence's
    positions, read through ``read_window`` in the dtype of the field's segments (their
    common numpy result type when they differ), with the trainer's fill (-1 for
    ``sampling_mask``, else 0) where no segment covers a position. Empty when the micro-batch
    carries no segment of ``field``. Raises ValueError when the sequences cannot be named
    (no ``trace_ids``, or not one per sequence, or a trace id twice)."""
    segments = batch.payload or []
    mine = [segment for segment in segments if segment.field == field]
    if not mine:
        return {}
    if batch.trace_ids is None:
        raise ValueError(f"a micro-batch carries {field!r} by handle but no trace_ids to name its sequences")
    if len(batch.trace_ids) != len(batch.sequence_lengths):
        raise ValueError(
            f"{len(batch.trace_ids)} trace_ids for {len(batch.sequence_lengths)} sequence_lengths"
        )
    dtype = np.result_type(*(np.dtype(segment.dtype) for segment in mine))
    fill = FILLS.get(field, 0)
    rows: dict[str, bytes] = {}
    start = 0
    for length, trace_id in zip(batch.sequence_lengths, batch.trace_ids, strict=True):
        if trace_id != "":
            if trace_id in rows:
                raise ValueError(f"trace id {trace_id!r} names two sequences of one micro-batch")
            window = read_window(mine, field, start, start + length, dtype, fill=fill)
            assert window is not None  # the field has segments
            rows[trace_id] = window.tobytes()
        start += length
    return rows
