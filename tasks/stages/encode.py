"""Encode: build one rank's micro-batches from its samples' arrays and encode the payload.

The per-token fields are concatenated straight from the stored arrays (no Python lists
of tokens); a sample's advantages and temperatures are its own per-token arrays where the
producer gave them, else its cohort row's advantage and temperature broadcast over its
tokens (the env always is); rl weights follow tasks.stages.credit (zero on a loss token of
zero advantage).
Optional streams (ce and ref-kl weights, token types, mm_kwargs) are carried when any
sample of the micro-batch has them.

Under a wire that carries them (prime-rl 0f59b24), each sequence is named by its rollout id
(`trace_ids`) and a sample's side arrays by handle travel as its segments shifted to its
place in the micro-batch (`payload`): their rows are never read here.

Before the cut, a sample of the plain kind (the required arrays only, and perhaps its own
credit streams) is prepared as it completes: its token fields encoded once, as they will be
on the wire (`SampleWire`). At
the cut the rank's payload is then joined from those parts (`assemble_rank`): the same
bytes as `encode_rank`, since canonical MessagePack writes each element on its own.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from tasks.cohort import Cohort
from tasks.stages.credit import token_rl_weights
from tasks.stages.pack import MicroBatchPlan
from transport.codec import (
    array_elements,
    array_header,
    encode_microbatches,
    join_microbatch,
    repeated_elements,
    split_elements,
)
from transport.payload_segments import (
    PAYLOAD_FIELD,
    PayloadSegment,
    SegmentReader,
    clip_segments,
    read_windows,
    shift_segments,
)
from transport.schema import (
    MM_KWARGS_PREFIX,
    WIRE_559B447,
    EncodedTensor,
    MicroBatch,
    RoutedExperts,
    WireProfile,
)

PADDING_ENV = "padding"
PADDING_BRANCH = -1  # prime-rl's branch index of a sequence that is no rollout's


def _segments(plan: MicroBatchPlan, samples: Cohort, arrays: Mapping[str, Mapping[str, np.ndarray]]):
    """Per sample of the micro-batch: (arrays, advantage, temperature, env)."""
    ids = samples.labels["rollout_id"]
    for index in plan.samples:
        yield (
            arrays[ids[index]],
            float(samples.numeric["advantage"][index]),
            float(samples.numeric["temperature"][index]),
            samples.labels["env"][index],
        )


def build_microbatch(
    plan: MicroBatchPlan,
    samples: Cohort,
    arrays: Mapping[str, Mapping[str, np.ndarray]],
    wire: WireProfile = WIRE_559B447,
) -> MicroBatch:
    """One micro-batch: its samples concatenated, then `plan.padding` padding tokens."""
    batch = _microbatch(list(_segments(plan, samples, arrays)), plan.padding)
    ids = [samples.labels["rollout_id"][i] for i in plan.samples]
    if wire.carries("trace_ids"):
        for name, value in _sequence_values(ids, plan.padding).items():
            setattr(batch, name, value)
    lengths = [len(arrays[rid]["input_ids"]) for rid in ids]
    batch.payload = _placed_segments([arrays[rid].get(PAYLOAD_FIELD, []) for rid in ids], lengths)
    batch.validate()
    return batch


def _sequence_values(rollout_ids: list[str], pad: int) -> dict[str, list[Any]]:
    """trace_ids and branch_indices, one per sequence: rlship trains a rollout whole, as one
    branch; the padding sequence is no rollout's."""
    return {
        "trace_ids": [*rollout_ids, *([""] if pad else [])],
        "branch_indices": [0] * len(rollout_ids) + ([PADDING_BRANCH] if pad else []),
    }


def _placed_segments(
    per_sample: list[list[PayloadSegment]], lengths: list[int]
) -> list[PayloadSegment] | None:
    """The samples' segments clipped to their tokens and shifted to their places in the
    micro-batch, in sample order; None when no sample has any."""
    placed: list[PayloadSegment] = []
    offset = 0
    for segments, length in zip(per_sample, lengths, strict=True):
        placed += shift_segments(clip_segments(segments, 0, length), offset)
        offset += length
    return placed or None


def _microbatch(segments: list[tuple[Mapping[str, Any], float, float, str]], pad: int) -> MicroBatch:
    lengths = [len(a["input_ids"]) for a, *_ in segments]
    if pad:
        lengths.append(pad)

    def concat(parts: list[np.ndarray], pad_value: float, dtype: type) -> np.ndarray:
        if pad:
            parts = [*parts, np.full(pad, pad_value, dtype=dtype)]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

    env_names: list[str] = []
    for a, _, _, env in segments:
        env_names.extend([env] * len(a["input_ids"]))
    env_names.extend([PADDING_ENV] * pad)

    def optional_stream(name: str, fill: float, dtype: type) -> np.ndarray | None:
        """A stream some samples carry: theirs, `fill` for the others and the padding."""
        if not any(name in a for a, *_ in segments):
            return None
        return concat([a.get(name, np.full(len(a["input_ids"]), fill)) for a, *_ in segments], fill, dtype)

    has_ref = bool(segments) and all("ref_logprobs" in a for a, *_ in segments)
    experts = [a.get("routed_experts") for a, *_ in segments]
    routed = None
    if segments and all(e is not None for e in experts):
        shape = experts[0].shape[1:]
        if pad:
            experts.append(np.zeros((pad, *shape), dtype=experts[0].dtype))
        routed = RoutedExperts.from_array(np.concatenate(experts))
    return MicroBatch(
        input_ids=concat([a["input_ids"] for a, *_ in segments], 0, np.int64),
        loss_mask=concat([a["loss_mask"] for a, *_ in segments], False, np.bool_),
        advantages=concat([_per_token(a, "advantages", adv) for a, adv, _, _ in segments], 0.0, np.float64),
        inference_logprobs=concat([a["inference_logprobs"] for a, *_ in segments], 0.0, np.float64),
        position_ids=np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
        if lengths
        else np.zeros(0, dtype=np.int64),
        sequence_lengths=np.asarray(lengths, dtype=np.int64),
        temperatures=concat([_per_token(a, "temperatures", t) for a, _, t, _ in segments], 1.0, np.float64),
        env_names=env_names,
        seq_lens=np.asarray(lengths, dtype=np.int64),
        ref_logprobs=concat([a["ref_logprobs"] for a, *_ in segments], 0.0, np.float64) if has_ref else None,
        routed_experts=routed,
        mm_kwargs=_stacked_mm_kwargs([a for a, *_ in segments]),
        mm_token_type_ids=optional_stream("mm_token_type_ids", 0, np.int64),
        ce_weights=optional_stream("ce_weights", 0.0, np.float64),
        ref_kl_weights=optional_stream("ref_kl_weights", 0.0, np.float64),
        rl_weights=concat([token_rl_weights(a, adv) for a, adv, _, _ in segments], 0.0, np.float64),
    )


def _per_token(arrays: Mapping[str, Any], name: str, broadcast: float) -> np.ndarray:
    """A sample's per-token stream as the producer gave it, else its row's value on every token."""
    given = arrays.get(name)
    return np.full(len(arrays["input_ids"]), broadcast) if given is None else given


def _stacked_mm_kwargs(samples: list[Mapping[str, Any]]) -> dict[str, EncodedTensor] | None:
    """The micro-batch's mm_kwargs: each name's tensors of the samples that carry it,
    stacked along the first dimension in sample order (as prime-rl's packer does)."""
    names = dict.fromkeys(name for arrays in samples for name in arrays if name.startswith(MM_KWARGS_PREFIX))
    if not names:
        return None
    return {
        name[len(MM_KWARGS_PREFIX) :]: EncodedTensor.concatenate(
            name[len(MM_KWARGS_PREFIX) :], [arrays[name] for arrays in samples if name in arrays]
        )
        for name in names
    }


def encode_rank(
    plans: list[MicroBatchPlan],
    samples: Cohort,
    arrays: Mapping[str, Mapping[str, np.ndarray]],
    wire: WireProfile = WIRE_559B447,
) -> bytes | bytearray | memoryview:
    """A rank's whole payload for one step."""
    return encode_microbatches([build_microbatch(plan, samples, arrays, wire) for plan in plans], wire)


def with_inline_rows(rollouts: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The rollouts with the rows rlship kept in files for fields the trainers take inline
    read back into their arrays (what the encoder carries inline); their handles stay."""
    out: dict[str, Mapping[str, Any]] = dict(rollouts)
    with SegmentReader() as reader:
        for rollout_id, arrays in rollouts.items():
            segments = arrays.get(PAYLOAD_FIELD, [])
            inline = [segment for segment in segments if segment.inline]
            if not inline:
                continue
            windows = read_windows(inline, len(arrays["input_ids"]), reader)
            handles = [segment for segment in segments if not segment.inline]
            rest = {name: value for name, value in arrays.items() if name != PAYLOAD_FIELD}
            out[rollout_id] = rest | windows | ({PAYLOAD_FIELD: handles} if handles else {})
    return out


def rank_rollout_ids(plans: list[MicroBatchPlan], samples: Cohort) -> list[str]:
    """The rollouts whose arrays this rank's encoder needs."""
    ids = samples.labels["rollout_id"]
    return [ids[i] for plan in plans for i in plan.samples]


# -- the payload joined from parts prepared before the cut ------------------------------------

# The token fields a sample's own arrays make, encoded when it is prepared; the others
# (advantages, temperatures, env_names, rl_weights) follow from its cohort row at the cut.
SAMPLE_WIRE_FIELDS: tuple[str, ...] = ("input_ids", "loss_mask", "inference_logprobs", "position_ids")
TOKEN_FIELDS: tuple[str, ...] = (*SAMPLE_WIRE_FIELDS, "advantages", "temperatures", "env_names", "rl_weights")
_TRUE = array_elements("loss_mask", np.array([True]))[0]
# The rl-weight elements 0.0 and 1.0, indexed by a loss-mask bit.
_RL_WEIGHT_TABLE = np.frombuffer(array_elements("rl_weights", np.array([0.0, 1.0])), np.uint8).reshape(2, 9)


@dataclass(frozen=True)
class SampleWire:
    """A sample's token fields as they will be on the wire (elements, no array header), and
    its side arrays' segments."""

    tokens: int
    fields: dict[str, bytes]
    segments: tuple[PayloadSegment, ...] = ()

    def to_bytes(self) -> bytes:
        stored = [segment.to_stored() for segment in self.segments]
        return msgpack.packb([self.tokens, self.fields, stored], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> SampleWire:
        tokens, fields, stored = msgpack.unpackb(data, raw=False)
        return cls(int(tokens), dict(fields), tuple(PayloadSegment.from_values(v) for v in stored))

    def loss_mask(self) -> np.ndarray:
        return np.frombuffer(self.fields["loss_mask"], np.uint8) == _TRUE

    def token_arrays(self) -> dict[str, np.ndarray]:
        """input_ids and loss_mask, read back from the wire parts (for the sample lines)."""
        ids = msgpack.unpackb(array_header(self.tokens) + self.fields["input_ids"])
        return {"input_ids": np.asarray(ids, np.int64), "loss_mask": self.loss_mask()}


# The dtype kinds each required array may have on its way to the wire (its values are
# finalize's to check: a prepared rollout it drops is never joined), and the credit streams'.
_PLAIN_KINDS = {"input_ids": "iu", "loss_mask": "b", "inference_logprobs": "f"}
_CREDIT_KINDS = {"advantages": "f", "rl_weights": "f", "temperatures": "f"}


def _plain(arrays: Mapping[str, Any]) -> bool:
    """Whether a rollout holds the required arrays only (and perhaps handles, and credit
    streams whose wire parts do not depend on its cohort row), one-dimensional, of one
    length. Given rl weights without given advantages follow the row's advantage (zero or
    not): such a rollout is left out."""
    names = set(arrays) - {PAYLOAD_FIELD}
    if not set(_PLAIN_KINDS) <= names or not names <= set(_PLAIN_KINDS) | set(_CREDIT_KINDS):
        return False
    if "rl_weights" in names and "advantages" not in names:
        return False
    if any(segment.inline for segment in arrays.get(PAYLOAD_FIELD, ())):
        return False
    length = len(arrays["input_ids"])
    kinds = _PLAIN_KINDS | {name: _CREDIT_KINDS[name] for name in names & set(_CREDIT_KINDS)}
    return all(
        arrays[name].ndim == 1 and len(arrays[name]) == length and arrays[name].dtype.kind in allowed
        for name, allowed in kinds.items()
    )


def prepare_samples(rollouts: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, SampleWire]:
    """The wire parts of those rollouts that hold the required arrays only (and perhaps
    their own credit streams: `_plain`), encoded in one pass per field. A rollout with an
    optional stream is left out: whether and how such a stream is carried is decided per
    micro-batch, so its rank is built from the arrays."""
    plain = {rid: arrays for rid, arrays in rollouts.items() if _plain(arrays)}
    if not plain:
        return {}
    lengths = [len(arrays["input_ids"]) for arrays in plain.values()]
    starts = np.repeat(np.cumsum([0, *lengths[:-1]]), lengths)
    values = {
        "input_ids": np.concatenate([a["input_ids"] for a in plain.values()]).astype(np.int64),
        "loss_mask": np.concatenate([a["loss_mask"] for a in plain.values()]).astype(np.bool_),
        "inference_logprobs": np.concatenate([a["inference_logprobs"] for a in plain.values()]).astype(
            np.float64
        ),
        "position_ids": np.arange(sum(lengths), dtype=np.int64) - starts,
    }
    parts = {name: split_elements(name, values[name], lengths) for name in SAMPLE_WIRE_FIELDS}
    credit = _credit_parts(plain)
    return {
        rid: SampleWire(
            tokens,
            {name: parts[name][i] for name in SAMPLE_WIRE_FIELDS} | credit.get(rid, {}),
            tuple(plain[rid].get(PAYLOAD_FIELD, ())),
        )
        for i, (rid, tokens) in enumerate(zip(plain, lengths, strict=True))
    }


def _credit_parts(plain: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, bytes]]:
    """The wire parts of the rollouts' own credit streams, one pass per field over those that
    have it: advantages and temperatures as given, rl weights (`token_rl_weights`) of those
    with their own advantages."""
    out: dict[str, dict[str, bytes]] = {}
    for name in ("advantages", "temperatures", "rl_weights"):
        source = "advantages" if name == "rl_weights" else name
        having = [rid for rid, arrays in plain.items() if source in arrays]
        if not having:
            continue
        made = [token_rl_weights(plain[rid]) if name == "rl_weights" else plain[rid][name] for rid in having]
        lengths = [len(plain[rid]["input_ids"]) for rid in having]
        values = np.concatenate(made).astype(np.float64)
        for rid, part in zip(having, split_elements(name, values, lengths), strict=True):
            out.setdefault(rid, {})[name] = part
    return out


# The token fields made at the cut for a sample without its own: from its cohort row
# (advantage, temperature, env) and, for rl weights, its loss mask.
_FROM_COLUMN = {"advantages": "advantage", "temperatures": "temperature"}
_CUT_MADE = (*_FROM_COLUMN, "env_names", "rl_weights")


def _samples_part(name: str, rows: list[tuple[SampleWire, int]], samples: Cohort) -> list[bytes]:
    """A micro-batch's samples' elements of a token field: each sample's own, or made at the
    cut (`_cut_made`), for all of them at once when none has its own."""
    if name in _CUT_MADE and not any(name in wire.fields for wire, _ in rows):
        return [_cut_made(name, rows, samples)]
    return [wire.fields.get(name) or _cut_made(name, [(wire, i)], samples) for wire, i in rows]


def _cut_made(name: str, rows: list[tuple[SampleWire, int]], samples: Cohort) -> bytes:
    """The elements of a token field the samples have not of their own, made from their
    cohort rows, joined: a repeat of each value over its tokens; rl weights
    (`token_rl_weights` of the plain kind) are 1.0 on loss tokens unless the advantage is
    zero, one table lookup over the joined loss masks (a sample at a time, this was the most
    of a join's time)."""
    indices, tokens = [i for _, i in rows], [wire.tokens for wire, _ in rows]
    if name in _FROM_COLUMN:
        return array_elements(name, np.repeat(samples.numeric[_FROM_COLUMN[name]][indices], tokens))
    if name == "env_names":
        return b"".join(repeated_elements(name, samples.labels["env"][i], wire.tokens) for wire, i in rows)
    masks = np.frombuffer(b"".join(wire.fields["loss_mask"] for wire, _ in rows), np.uint8) == _TRUE
    masks &= np.repeat(samples.numeric["advantage"][indices] != 0.0, tokens)
    return _RL_WEIGHT_TABLE[masks.view(np.uint8)].tobytes()


@functools.lru_cache(maxsize=8)
def _padding_parts(pad: int) -> dict[str, bytes]:
    """The padding tokens' elements of every token field, from a padding-only micro-batch
    (the same few sizes recur across a step's micro-batches)."""
    batch = _microbatch([], pad)
    parts = {name: array_elements(name, getattr(batch, name)) for name in TOKEN_FIELDS if name != "env_names"}
    parts["env_names"] = repeated_elements("env_names", PADDING_ENV, pad)
    return parts


def assemble_rank(
    plans: list[MicroBatchPlan],
    samples: Cohort,
    wires: Mapping[str, SampleWire],
    wire: WireProfile = WIRE_559B447,
) -> bytes:
    """The rank's payload joined from its samples' wire parts: `encode_rank`'s bytes for
    samples of the plain kind, without building a micro-batch."""
    ids = samples.labels["rollout_id"]
    out = [array_header(len(plans))]
    for plan in plans:
        rows = [(wires[ids[i]], i) for i in plan.samples]
        padding = _padding_parts(plan.padding) if plan.padding else {}
        parts = {name: [*_samples_part(name, rows, samples), padding.get(name, b"")] for name in TOKEN_FIELDS}
        lengths = [sample.tokens for sample, _ in rows] + ([plan.padding] if plan.padding else [])
        values: dict[str, Any] = {}
        if wire.carries("trace_ids"):
            values = _sequence_values([ids[i] for i in plan.samples], plan.padding)
        placed = _placed_segments([list(sample.segments) for sample, _ in rows], lengths[: len(rows)])
        if placed:
            values[PAYLOAD_FIELD] = placed
        out += join_microbatch(parts, lengths, wire, values)
    return b"".join(out)


def rank_segments(
    plans: list[MicroBatchPlan], samples: Cohort, segments_of: Mapping[str, Any]
) -> list[PayloadSegment]:
    """Every segment of the rank's payload, in payload order (micro-batch, then sample)."""
    ids = samples.labels["rollout_id"]
    return [segment for plan in plans for i in plan.samples for segment in segments_of[ids[i]]]
