"""Encode: build one rank's micro-batches from its samples' arrays and encode the payload.

The per-token fields are concatenated straight from the stored arrays (no Python lists
of tokens); sample-level annotations (advantage, temperature, env) are broadcast over the
sample's tokens; zero-advantage tokens get zero rl weight (the prune stage's rule).
Optional streams (ce and ref-kl weights, token types, mm_kwargs) are carried when any
sample of the micro-batch has them.

Before the cut, a sample of the plain kind (the required arrays only) is prepared as it
completes: its token fields encoded once, as they will be on the wire (`SampleWire`). At
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
from tasks.stages.pack import MicroBatchPlan
from tasks.stages.prune import token_rl_weights
from transport.codec import (
    array_elements,
    array_header,
    encode_microbatches,
    join_microbatch,
    repeated_elements,
    split_elements,
)
from transport.schema import MM_KWARGS_PREFIX, EncodedTensor, MicroBatch, RoutedExperts

PADDING_ENV = "padding"


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
    plan: MicroBatchPlan, samples: Cohort, arrays: Mapping[str, Mapping[str, np.ndarray]]
) -> MicroBatch:
    """One micro-batch: its samples concatenated, then `plan.padding` padding tokens."""
    return _microbatch(list(_segments(plan, samples, arrays)), plan.padding)


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
        advantages=concat([np.full(len(a["input_ids"]), adv) for a, adv, _, _ in segments], 0.0, np.float64),
        inference_logprobs=concat([a["inference_logprobs"] for a, *_ in segments], 0.0, np.float64),
        position_ids=np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
        if lengths
        else np.zeros(0, dtype=np.int64),
        sequence_lengths=np.asarray(lengths, dtype=np.int64),
        temperatures=concat([np.full(len(a["input_ids"]), t) for a, _, t, _ in segments], 1.0, np.float64),
        env_names=env_names,
        seq_lens=np.asarray(lengths, dtype=np.int64),
        ref_logprobs=concat([a["ref_logprobs"] for a, *_ in segments], 0.0, np.float64) if has_ref else None,
        routed_experts=routed,
        mm_kwargs=_stacked_mm_kwargs([a for a, *_ in segments]),
        mm_token_type_ids=optional_stream("mm_token_type_ids", 0, np.int64),
        ce_weights=optional_stream("ce_weights", 0.0, np.float64),
        ref_kl_weights=optional_stream("ref_kl_weights", 0.0, np.float64),
        rl_weights=concat(
            [token_rl_weights(a["loss_mask"], adv) for a, adv, _, _ in segments], 0.0, np.float64
        ),
    )


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
    plans: list[MicroBatchPlan], samples: Cohort, arrays: Mapping[str, Mapping[str, np.ndarray]]
) -> bytes | bytearray | memoryview:
    """A rank's whole payload for one step."""
    return encode_microbatches([build_microbatch(plan, samples, arrays) for plan in plans])


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
    """A sample's token fields as they will be on the wire (elements, no array header)."""

    tokens: int
    fields: dict[str, bytes]

    def to_bytes(self) -> bytes:
        return msgpack.packb([self.tokens, self.fields], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> SampleWire:
        tokens, fields = msgpack.unpackb(data, raw=False)
        return cls(int(tokens), dict(fields))

    def loss_mask(self) -> np.ndarray:
        return np.frombuffer(self.fields["loss_mask"], np.uint8) == _TRUE

    def token_arrays(self) -> dict[str, np.ndarray]:
        """input_ids and loss_mask, read back from the wire parts (for the sample lines)."""
        ids = msgpack.unpackb(array_header(self.tokens) + self.fields["input_ids"])
        return {"input_ids": np.asarray(ids, np.int64), "loss_mask": self.loss_mask()}


# The dtype kinds each required array may have on its way to the wire (its values are
# finalize's to check: a prepared rollout it drops is never joined).
_PLAIN_KINDS = {"input_ids": "iu", "loss_mask": "b", "inference_logprobs": "f"}


def _plain(arrays: Mapping[str, Any]) -> bool:
    """Whether a rollout holds the required arrays only, one-dimensional, of one length."""
    if set(arrays) != set(_PLAIN_KINDS):
        return False
    length = len(arrays["input_ids"])
    return all(
        a.ndim == 1 and len(a) == length and a.dtype.kind in _PLAIN_KINDS[name] for name, a in arrays.items()
    )


def prepare_samples(rollouts: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, SampleWire]:
    """The wire parts of those rollouts that hold the required arrays only, encoded in one
    pass per field. A rollout with an optional stream is left out: whether and how such a
    stream is carried is decided per micro-batch, so its rank is built from the arrays."""
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
    return {
        rid: SampleWire(tokens, {name: parts[name][i] for name in SAMPLE_WIRE_FIELDS})
        for i, (rid, tokens) in enumerate(zip(plain, lengths, strict=True))
    }


def _rl_weight_elements(wire: SampleWire, advantage: float) -> bytes:
    """`token_rl_weights` over the wire's loss mask: 1.0 on loss tokens, unless the
    advantage is zero."""
    if advantage == 0.0:
        return repeated_elements("rl_weights", 0.0, wire.tokens)
    return _RL_WEIGHT_TABLE[wire.loss_mask().view(np.uint8)].tobytes()


@functools.lru_cache(maxsize=8)
def _padding_parts(pad: int) -> dict[str, bytes]:
    """The padding tokens' elements of every token field, from a padding-only micro-batch
    (the same few sizes recur across a step's micro-batches)."""
    batch = _microbatch([], pad)
    parts = {name: array_elements(name, getattr(batch, name)) for name in TOKEN_FIELDS if name != "env_names"}
    parts["env_names"] = repeated_elements("env_names", PADDING_ENV, pad)
    return parts


def assemble_rank(plans: list[MicroBatchPlan], samples: Cohort, wires: Mapping[str, SampleWire]) -> bytes:
    """The rank's payload joined from its samples' wire parts: `encode_rank`'s bytes for
    samples of the plain kind, without building a micro-batch."""
    ids = samples.labels["rollout_id"]
    out = [array_header(len(plans))]
    for plan in plans:
        rows = [(wires[ids[i]], i) for i in plan.samples]
        padding = _padding_parts(plan.padding) if plan.padding else {}
        parts = {
            name: [*(_sample_part(name, wire, samples, i) for wire, i in rows), padding.get(name, b"")]
            for name in TOKEN_FIELDS
        }
        lengths = [wire.tokens for wire, _ in rows] + ([plan.padding] if plan.padding else [])
        out += join_microbatch(parts, lengths)
    return b"".join(out)


def _sample_part(name: str, wire: SampleWire, samples: Cohort, index: int) -> bytes:
    """One sample's elements of a token field: its own, or made from its cohort row."""
    if name in wire.fields:
        return wire.fields[name]
    if name == "advantages":
        return repeated_elements(name, float(samples.numeric["advantage"][index]), wire.tokens)
    if name == "temperatures":
        return repeated_elements(name, float(samples.numeric["temperature"][index]), wire.tokens)
    if name == "env_names":
        return repeated_elements(name, samples.labels["env"][index], wire.tokens)
    return _rl_weight_elements(wire, float(samples.numeric["advantage"][index]))
