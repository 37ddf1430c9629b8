"""Encode: build one rank's micro-batches from its samples' arrays and encode the payload.

The per-token fields are concatenated straight from the stored arrays (no Python lists
of tokens); sample-level annotations (advantage, temperature, env) are broadcast over the
sample's tokens; zero-advantage tokens get zero rl weight (the prune stage's rule).
Optional streams (ce and ref-kl weights, token types, mm_kwargs) are carried when any
sample of the micro-batch has them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tasks.cohort import Cohort
from tasks.stages.pack import MicroBatchPlan
from tasks.stages.prune import token_rl_weights
from transport.codec import encode_microbatches
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
    segments = list(_segments(plan, samples, arrays))
    lengths = [len(a["input_ids"]) for a, *_ in segments]
    if plan.padding:
        lengths.append(plan.padding)
    pad = plan.padding

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
