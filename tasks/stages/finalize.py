"""Finalize: check that every cut rollout can really train and stamp the annotations the
later stages and the record use (step, advantage, staleness, token counts). A rollout that
fails a check is dropped with a reason; it never fails the step.

Most rollouts were checked already where their bytes were made: rlship's producer runs
`check_rollout_arrays` before it writes and sends what the run's own limits still need, and
the size of the blob it wrote (`PayloadFacts`), in the stream entry; they reach the cut as
cohort columns. For those, finalize reads no array: it asks Redis each stored blob's size
(STRLEN), and only a blob gone (dropped) or of another size than the producer wrote (written
over since: read and checked whole) costs a read. The encoder's read is then the one read of
each byte. A rollout without facts (written by other code, or cut from a checkpoint older
than them) has its arrays read and checked here, as before.

A rollout with side arrays by handle (`payload` segments) says so in its facts: its blob
(tokens and segments; the rows stay in their files) is read for its segments, which are
checked against the files as they are at the cut; its arrays are not checked again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.cohort import Cohort
from tasks.manifest import StepManifest
from tasks.stages.credit import CREDIT_TOKENS_COLUMN, count_trainable, credit_kinds
from tasks.stages.prune import drop_field, trainable_tokens, worker_drops
from transport.numbering import staleness
from transport.payload_segments import (
    ANYWHERE,
    PAYLOAD_FIELD,
    SideArrays,
    rows_file_problem,
    segment_fields,
    segments_problem,
)
from transport.schema import MM_KWARGS_PREFIX, EncodedTensor

REQUIRED_ARRAYS: tuple[str, ...] = ("input_ids", "loss_mask", "inference_logprobs")
# The credit streams: per-token values that otherwise follow from the record. `advantages` is
# the producer's own credit (its algorithm's, per token): rlship then ships it as given and
# computes no group baseline for the rollout (docs/integrators.md, "Credit").
CREDIT_ARRAYS: tuple[str, ...] = ("advantages", "rl_weights", "temperatures")
# Optional per-token streams a producer may supply, one value per token (routed experts:
# [tokens, layers, topk]); the encoder carries each into the micro-batch field of its name.
OPTIONAL_TOKEN_ARRAYS: tuple[str, ...] = (
    "ref_logprobs",
    "routed_experts",
    "ce_weights",
    "ref_kl_weights",
    "mm_token_type_ids",
    *CREDIT_ARRAYS,
)
FLOAT_ARRAYS: tuple[str, ...] = (
    "inference_logprobs",
    "ref_logprobs",
    "ce_weights",
    "ref_kl_weights",
    *CREDIT_ARRAYS,
)
# Every array name a rollout may carry besides the multimodal ones (`mm_kwargs.*`): another is
# a producer's mistake (a misspelt `ref_logprob` would otherwise be stored and never used).
KNOWN_ARRAYS: tuple[str, ...] = (*REQUIRED_ARRAYS, *OPTIONAL_TOKEN_ARRAYS)


# The cohort columns holding a producer's `PayloadFacts` (NaN: the rollout came without).
FACT_COLUMNS: tuple[str, ...] = ("payload_loss_tokens", "payload_max_token_id", "payload_bytes")
# How many segments of side arrays by handle a rollout has (absent, NaN: none), and the
# bytes they need of their one file (labels `rows_field`, `rows_file`).
SEGMENTS_COLUMN = "payload_segments"
ROWS_BYTES_COLUMN = "payload_rows_bytes"


@dataclass(frozen=True)
class PayloadFacts:
    """What is left to check of arrays that passed `check_rollout_arrays` at the producer:
    every other check depends on the arrays alone, these two on the run's limits and the
    rollout's advantage."""

    # Tokens with loss_mask set (and a non-zero rl weight, if given): those that train, if
    # the advantage is not 0 (a given per-token credit counts its own: tasks.stages.credit).
    loss_tokens: int
    max_token_id: int  # against the run's vocabulary (the producer checked >= 0)
    payload_bytes: int  # the blob's size as written: a blob of another size was written over
    # Side arrays by handle, checked against their files at the cut: how many segments, and
    # when they are all in one file, that file, the bytes they need of it and a field of theirs.
    segments: int = 0
    rows_bytes: int = 0
    rows_field: str = ""
    rows_file: str = ""

    @classmethod
    def of(cls, arrays: Mapping[str, Any], payload_bytes: int) -> PayloadFacts:
        """The facts of arrays that passed `check_rollout_arrays`, stored as `payload_bytes`."""
        ids = arrays["input_ids"]
        max_id = int(ids.max()) if len(ids) else -1
        weighted = {name: arrays[name] for name in ("loss_mask", "rl_weights") if name in arrays}
        loss_tokens = count_trainable(weighted)
        segments = arrays.get(PAYLOAD_FIELD, [])
        if len({segment.file for segment in segments}) != 1:
            return cls(loss_tokens, max_id, payload_bytes, len(segments))
        needed = max(segment.offset + segment.nbytes for segment in segments)
        if needed == 0:  # rows of no bytes (no tokens, or an empty dtype): finalize reads the segments
            return cls(loss_tokens, max_id, payload_bytes, len(segments))
        return cls(
            loss_tokens, max_id, payload_bytes, len(segments), needed, segments[0].field, segments[0].file
        )

    def to_wire(self) -> str:
        """`loss max bytes`, then `segments`, then `rows_bytes field file` (the file last: a
        path may hold spaces)."""
        words = [self.loss_tokens, self.max_token_id, self.payload_bytes]
        words += [self.segments] if self.segments else []
        words += [self.rows_bytes, self.rows_field, self.rows_file] if self.rows_file else []
        return " ".join(map(str, words))

    @classmethod
    def from_wire(cls, data: bytes | str | None) -> PayloadFacts | None:
        """The facts of a stream entry; None when it has none or they do not parse (the
        rollout's arrays are then checked at finalize)."""
        try:
            text = data.decode() if isinstance(data, bytes) else data or ""
            words = text.split(maxsplit=6)
            numbers = [int(word) for word in words[:4]] + ([int(words[4])] if len(words) == 7 else [])
        except ValueError:  # not UTF-8, or a word not a number
            return None
        if (
            len(words) not in (3, 4, 7)
            or numbers[0] < 0
            or numbers[2] <= 0
            or any(n <= 0 for n in numbers[3:])
        ):
            return None
        return cls(*numbers, *words[5:])  # type: ignore[arg-type]

    def columns(self) -> dict[str, float]:
        values = (self.loss_tokens, self.max_token_id, self.payload_bytes)
        handles = {SEGMENTS_COLUMN: float(self.segments)} if self.segments else {}
        needed = {ROWS_BYTES_COLUMN: float(self.rows_bytes)} if self.rows_file else {}
        return dict(zip(FACT_COLUMNS, values, strict=True)) | handles | needed

    def labels(self) -> dict[str, str]:
        return {"rows_field": self.rows_field, "rows_file": self.rows_file} if self.rows_file else {}


@dataclass
class FinalizedStep:
    """The cut rollouts that passed every check, annotated, and those that did not."""

    samples: Cohort
    failures: dict[str, str]


@dataclass(frozen=True)
class StepVerdict:
    """Whether a cut step ships anything: the rollouts that will train (passed every check
    and keep a trainable token) and the dropped ones by reason (field or prune rule). The
    orchestrator reads it before cutting the next step: an empty step is cut again under
    the same number, as prime-rl does not advance on an empty batch."""

    shipped: int
    dropped: dict[str, int]

    @property
    def empty(self) -> bool:
        return self.shipped == 0

    def to_wire(self) -> dict[str, Any]:
        return {"shipped": self.shipped, "dropped": self.dropped}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> StepVerdict:
        return cls(shipped=int(data["shipped"]), dropped={str(k): int(v) for k, v in data["dropped"].items()})


def step_drops(result: FinalizedStep) -> dict[str, str]:
    """Every cut rollout the workers will not ship, with its reason: those finalize refused,
    and those prune will drop (a sample with no trainable token)."""
    trainable = result.samples.numeric["trainable_tokens"] > 0
    pruned = [
        rid for rid, keep in zip(result.samples.labels["rollout_id"], trainable, strict=True) if not keep
    ]
    return worker_drops(result.failures, pruned)


def step_verdict(result: FinalizedStep) -> StepVerdict:
    """What prune will keep of the finalized step: the dropped rollouts counted by field."""
    drops = step_drops(result)
    dropped: dict[str, int] = {}
    for reason in drops.values():
        dropped[drop_field(reason)] = dropped.get(drop_field(reason), 0) + 1
    shipped = int(np.count_nonzero(result.samples.numeric["trainable_tokens"] > 0))
    return StepVerdict(shipped=shipped, dropped=dropped)


def check_rollout_arrays(
    arrays: Mapping[str, Any],
    expected_tokens: int,
    seq_len: int,
    vocab_size: int,
    side_arrays: SideArrays = ANYWHERE,
) -> str | None:
    """Why a rollout's arrays (and segments) cannot train (naming the array and the value),
    or None."""
    known = (*KNOWN_ARRAYS, PAYLOAD_FIELD)
    unknown = sorted(n for n in arrays if n not in known and not n.startswith(MM_KWARGS_PREFIX))
    if unknown:
        return (
            f"{unknown[0]}: not an array rlship carries (it carries {', '.join(KNOWN_ARRAYS)}, "
            f"{MM_KWARGS_PREFIX}* and {PAYLOAD_FIELD} segments)"
        )
    for name in REQUIRED_ARRAYS:
        if name not in arrays:
            return f"{name}: missing from the payload"
        if arrays[name].ndim != 1:
            return f"{name}: expected one dimension, got shape {arrays[name].shape}"
    num_tokens = len(arrays["input_ids"])
    if num_tokens != expected_tokens:
        return f"input_ids: length {num_tokens}, the record says {expected_tokens} tokens"
    if num_tokens > seq_len:
        return too_long(num_tokens, seq_len)
    for name in ("loss_mask", "inference_logprobs", *OPTIONAL_TOKEN_ARRAYS):
        if name not in arrays:
            continue
        if arrays[name].ndim == 0 or (name != "routed_experts" and arrays[name].ndim != 1):
            dimensions = "a token dimension first" if name == "routed_experts" else "one dimension"
            return f"{name}: expected {dimensions}, got shape {arrays[name].shape}"
        if len(arrays[name]) != num_tokens:
            return f"{name}: length {len(arrays[name])}, expected {num_tokens} (len(input_ids))"
    for name in ("mm_token_type_ids", "routed_experts"):  # object arrays would be stored as pointers
        if name in arrays and arrays[name].dtype.kind not in "iu":
            return f"{name}: dtype {arrays[name].dtype}, expected integers"
    for name, value in arrays.items():
        if name.startswith(MM_KWARGS_PREFIX) and not isinstance(value, EncodedTensor):
            return f"{name}: expected an encoded tensor (dtype, shape, data), got {type(value).__name__}"
    ids = arrays["input_ids"]
    if ids.dtype.kind not in "iu":
        return f"input_ids: dtype {ids.dtype}, expected integers"
    if num_tokens and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return out_of_vocabulary(int(ids.min()) if int(ids.min()) < 0 else int(ids.max()), vocab_size)
    if arrays["loss_mask"].dtype.kind != "b":
        return f"loss_mask: dtype {arrays['loss_mask'].dtype}, expected bool"
    for name in FLOAT_ARRAYS:
        if name in arrays and arrays[name].dtype.kind != "f":
            return f"{name}: dtype {arrays[name].dtype}, expected floats (float16, float32 or float64)"
        if name in arrays and not np.isfinite(arrays[name]).all():
            bad = arrays[name][~np.isfinite(arrays[name])][0]
            return f"{name}: non-finite value {bad}"
    if "temperatures" in arrays and num_tokens and not (arrays["temperatures"] > 0).all():
        at = int(np.flatnonzero(~(arrays["temperatures"] > 0))[0])
        return f"temperatures: value {arrays['temperatures'][at]} at token {at}, expected > 0"
    if PAYLOAD_FIELD in arrays:
        return _segments_problem(arrays, num_tokens, side_arrays)
    return None


def _segments_problem(arrays: Mapping[str, Any], num_tokens: int, side_arrays: SideArrays) -> str | None:
    """Why a rollout's segments cannot train: its arrays (those inline) beside them."""
    segments = arrays.get(PAYLOAD_FIELD)
    if not isinstance(segments, list):
        return f"{PAYLOAD_FIELD}: the producer's facts say segments, its blob holds none"
    fields = segment_fields(segment for segment in segments if not segment.inline)
    if side_arrays.refused_by is not None and fields:
        return (
            f"{PAYLOAD_FIELD}: wire {side_arrays.refused_by} cannot carry side arrays by handle "
            f"({', '.join(fields)}); send them inline or run with --wire prime-rl-0f59b24"
        )
    inline = [field for field in segment_fields(segments) if field in arrays]
    if inline:
        return f"{PAYLOAD_FIELD}.{inline[0]}: given both inline and by handle (one way or the other)"
    return segments_problem(segments, num_tokens, side_arrays)


def _credit_problem(arrays: Mapping[str, Any], given: bool) -> str | None:
    """Why arrays read whole disagree with the credit their stream entry announced (a blob
    written over since, or arrays stored by other code than rlship's producer)."""
    if "advantages" in arrays and not given:
        return "advantages: in the arrays, but the rollout's stream entry has no credit summary"
    if given and "advantages" not in arrays:
        return "advantages: the rollout's stream entry announced them, its arrays have none"
    return None


def too_long(num_tokens: int, seq_len: int) -> str:
    return f"input_ids: length {num_tokens} exceeds seq_len {seq_len}"


def out_of_vocabulary(token_id: int, vocab_size: int) -> str:
    return f"input_ids: token id {token_id} outside [0, {vocab_size})"


def _fact_column(cohort: Cohort, name: str) -> np.ndarray:
    """A fact column of the cohort; NaN throughout for a cohort from before the facts."""
    return cohort.numeric.get(name, np.full(len(cohort), np.nan))


def rollouts_with_facts(cohort: Cohort) -> list[str]:
    """The cut rollouts finalize need not read if their blobs are as the producer wrote them."""
    has_facts = ~np.isnan(_fact_column(cohort, FACT_COLUMNS[0]))
    return [cohort.labels["rollout_id"][i] for i in np.flatnonzero(has_facts).tolist()]


def _checked_by_file(cohort: Cohort, side_arrays: SideArrays) -> np.ndarray:
    """The rows whose facts name the one file of their segments: checked against it without
    reading their blobs (unless the run's wire refuses handles: that needs the segments)."""
    named = np.array([bool(file) for file in cohort.labels["rows_file"]], dtype=bool)
    return named & (side_arrays.refused_by is None)


def rollouts_with_handles(cohort: Cohort, read: Iterable[str], side_arrays: SideArrays) -> list[str]:
    """The cut rollouts checked by their facts whose segments finalize reads (their blobs)
    to check against the files: those with side arrays by handle in several files (or on a
    wire that refuses them), but for those `read`."""
    has_handles = (_fact_column(cohort, SEGMENTS_COLUMN) > 0) & ~_checked_by_file(cohort, side_arrays)
    skip = set(read)
    ids = cohort.labels["rollout_id"]
    return [ids[i] for i in np.flatnonzero(has_handles).tolist() if ids[i] not in skip]


def rollouts_to_read(cohort: Cohort, stored_bytes: Mapping[str, int]) -> list[str]:
    """The cut rollouts whose arrays finalize reads and checks whole: those without facts and
    those whose stored blob (`stored_bytes`, 0 if gone) is not the size their producer wrote."""
    ids = cohort.labels["rollout_id"]
    stored = np.array([stored_bytes.get(rollout_id, 0) for rollout_id in ids], dtype=np.float64)
    written = _fact_column(cohort, FACT_COLUMNS[2])
    return [ids[i] for i in np.flatnonzero(np.isnan(written) | (stored != written)).tolist()]


def finalize_step(
    manifest: StepManifest,
    payloads: Mapping[str, Mapping[str, Any] | Exception],
    handles: Mapping[str, Mapping[str, Any] | Exception] | None = None,
) -> FinalizedStep:
    """Check each cut rollout and annotate the ones that pass: by its arrays where they were
    read (`rollouts_to_read`), else by its producer's facts, and its segments of side arrays
    by handle against their files.

    `payloads` maps each rollout read to its arrays, or to the error met reading them;
    `handles` the same for the rollouts checked by their facts that have segments
    (`rollouts_with_handles`), read for their segments.
    """
    cohort = manifest.effective
    config = manifest.config
    ids = cohort.labels["rollout_id"]
    expected = cohort.total_tokens()
    loss, max_id = (_fact_column(cohort, name) for name in FACT_COLUMNS[:2])
    # Rows checked by their facts, all at once (a cut of thousands at the cut's pace).
    by_facts = ~np.isnan(loss) & np.array([rid not in payloads for rid in ids], dtype=bool)
    long_rows = by_facts & (expected > config.seq_len)
    unknown_ids = by_facts & ~long_rows & (max_id >= config.vocab_size)
    keep = by_facts & ~long_rows & ~unknown_ids
    advantage = cohort.numeric["advantage"]
    credit_tokens = _fact_column(cohort, CREDIT_TOKENS_COLUMN)
    given = credit_kinds(credit_tokens)
    # The tokens that train: a given credit's own count, else the loss tokens, if the
    # rollout's advantage is not zero (rows read are counted from their arrays below).
    loss_tokens = np.where(keep, np.where(given, credit_tokens, trainable_tokens(loss, advantage)), 0.0)
    problems = {i: too_long(int(expected[i]), config.seq_len) for i in np.flatnonzero(long_rows).tolist()}
    for i in np.flatnonzero(unknown_ids).tolist():
        problems[i] = out_of_vocabulary(int(max_id[i]), config.vocab_size)
    by_file = _checked_by_file(cohort, config.side_arrays)
    rows_bytes = _fact_column(cohort, ROWS_BYTES_COLUMN)
    for i in np.flatnonzero(keep & (_fact_column(cohort, SEGMENTS_COLUMN) > 0)).tolist():
        stored = (handles or {}).get(ids[i])
        if by_file[i]:
            field, file = cohort.labels["rows_field"][i], cohort.labels["rows_file"][i]
            problem: str | None = rows_file_problem(field, file, int(rows_bytes[i]), config.side_arrays)
        elif stored is None or isinstance(stored, Exception):
            problem = f"payload: {stored or 'not found'}"
        else:
            problem = _segments_problem(stored, int(expected[i]), config.side_arrays)
        if problem is not None:
            problems[i] = problem
            keep[i] = False
            loss_tokens[i] = 0.0
    # Rows read: checked by their arrays.
    for i in np.flatnonzero(~by_facts).tolist():
        arrays = payloads.get(ids[i])
        if arrays is None or isinstance(arrays, Exception):
            problems[i] = f"payload: {arrays or 'not found'}"
            continue
        problem = check_rollout_arrays(
            arrays, int(expected[i]), config.seq_len, config.vocab_size, config.side_arrays
        ) or _credit_problem(arrays, bool(given[i]))
        if problem is not None:
            problems[i] = problem
            continue
        keep[i] = True
        loss_tokens[i] = count_trainable(arrays, float(advantage[i]))
    failures = {ids[i]: problems[i] for i in sorted(problems)}
    num_tokens = np.where(keep, expected, 0.0)
    annotated = cohort.with_numeric(
        step=np.full(len(cohort), float(manifest.step)),
        staleness=staleness(manifest.step, cohort.numeric["policy_version"], manifest.config.first_step),
        num_tokens=num_tokens,
        trainable_tokens=loss_tokens,
    )
    return FinalizedStep(samples=annotated.take(keep), failures=failures)
