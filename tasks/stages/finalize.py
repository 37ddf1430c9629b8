"""Finalize: check that every cut rollout can really train, materialize its arrays once,
and stamp the annotations the later stages and the record use (step, advantage,
staleness, token counts). A rollout that fails a check is dropped with a reason; it never
fails the step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.cohort import Cohort
from tasks.manifest import StepManifest
from tasks.stages.prune import count_trainable_tokens, drop_field, worker_drops
from transport.numbering import staleness
from transport.schema import MM_KWARGS_PREFIX, EncodedTensor

REQUIRED_ARRAYS: tuple[str, ...] = ("input_ids", "loss_mask", "inference_logprobs")
# Optional per-token streams a producer may supply, one value per token (routed experts:
# [tokens, layers, topk]); the encoder carries each into the micro-batch field of its name.
OPTIONAL_TOKEN_ARRAYS: tuple[str, ...] = (
    "ref_logprobs",
    "routed_experts",
    "ce_weights",
    "ref_kl_weights",
    "mm_token_type_ids",
)
FLOAT_ARRAYS: tuple[str, ...] = ("inference_logprobs", "ref_logprobs", "ce_weights", "ref_kl_weights")
# Every array name a rollout may carry besides the multimodal ones (`mm_kwargs.*`): another is
# a producer's mistake (a misspelt `ref_logprob` would otherwise be stored and never used).
KNOWN_ARRAYS: tuple[str, ...] = (*REQUIRED_ARRAYS, *OPTIONAL_TOKEN_ARRAYS)


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


def step_verdict(result: FinalizedStep) -> StepVerdict:
    """What prune will keep of the finalized step: a sample with no trainable token is
    dropped there, so it counts as dropped here."""
    trainable = result.samples.numeric["trainable_tokens"] > 0
    pruned = [
        rid for rid, keep in zip(result.samples.labels["rollout_id"], trainable, strict=True) if not keep
    ]
    dropped: dict[str, int] = {}
    for reason in worker_drops(result.failures, pruned).values():
        dropped[drop_field(reason)] = dropped.get(drop_field(reason), 0) + 1
    return StepVerdict(shipped=int(trainable.sum()), dropped=dropped)


def check_rollout_arrays(
    arrays: Mapping[str, Any], expected_tokens: int, seq_len: int, vocab_size: int
) -> str | None:
    """Why a rollout's arrays cannot train (naming the array and the value), or None."""
    unknown = sorted(n for n in arrays if n not in KNOWN_ARRAYS and not n.startswith(MM_KWARGS_PREFIX))
    if unknown:
        return (
            f"{unknown[0]}: not an array rlship carries (it carries {', '.join(KNOWN_ARRAYS)} and "
            f"{MM_KWARGS_PREFIX}*)"
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
        return f"input_ids: length {num_tokens} exceeds seq_len {seq_len}"
    for name in ("loss_mask", "inference_logprobs", *OPTIONAL_TOKEN_ARRAYS):
        if name in arrays and len(arrays[name]) != num_tokens:
            return f"{name}: length {len(arrays[name])}, expected {num_tokens} (len(input_ids))"
        if name in arrays and name != "routed_experts" and arrays[name].ndim != 1:
            return f"{name}: expected one dimension, got shape {arrays[name].shape}"
    if "mm_token_type_ids" in arrays and arrays["mm_token_type_ids"].dtype.kind not in "iu":
        return f"mm_token_type_ids: dtype {arrays['mm_token_type_ids'].dtype}, expected integers"
    for name, value in arrays.items():
        if name.startswith(MM_KWARGS_PREFIX) and not isinstance(value, EncodedTensor):
            return f"{name}: expected an encoded tensor (dtype, shape, data), got {type(value).__name__}"
    ids = arrays["input_ids"]
    if ids.dtype.kind not in "iu":
        return f"input_ids: dtype {ids.dtype}, expected integers"
    if num_tokens and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        return f"input_ids: token id {bad} outside [0, {vocab_size})"
    if arrays["loss_mask"].dtype.kind != "b":
        return f"loss_mask: dtype {arrays['loss_mask'].dtype}, expected bool"
    for name in FLOAT_ARRAYS:
        if name in arrays and not np.isfinite(arrays[name]).all():
            bad = arrays[name][~np.isfinite(arrays[name])][0]
            return f"{name}: non-finite value {bad}"
    return None


def finalize_step(
    manifest: StepManifest, payloads: Mapping[str, Mapping[str, np.ndarray] | Exception]
) -> FinalizedStep:
    """Check each cut rollout's payload and annotate the ones that pass.

    `payloads` maps rollout id to its arrays, or to the error met reading them.
    """
    cohort = manifest.effective
    keep = np.zeros(len(cohort), dtype=bool)
    num_tokens = np.zeros(len(cohort))
    trainable = np.zeros(len(cohort))
    failures: dict[str, str] = {}
    for i, rollout_id in enumerate(cohort.labels["rollout_id"]):
        arrays = payloads.get(rollout_id)
        if arrays is None or isinstance(arrays, Exception):
            failures[rollout_id] = f"payload: {arrays or 'not found'}"
            continue
        expected = int(cohort.numeric["num_input_tokens"][i] + cohort.numeric["num_output_tokens"][i])
        problem = check_rollout_arrays(arrays, expected, manifest.config.seq_len, manifest.config.vocab_size)
        if problem is not None:
            failures[rollout_id] = problem
            continue
        keep[i] = True
        num_tokens[i] = len(arrays["input_ids"])
        trainable[i] = count_trainable_tokens(arrays["loss_mask"], float(cohort.numeric["advantage"][i]))
    annotated = cohort.with_numeric(
        step=np.full(len(cohort), float(manifest.step)),
        staleness=staleness(manifest.step, cohort.numeric["policy_version"], manifest.config.first_step),
        num_tokens=num_tokens,
        trainable_tokens=trainable,
    )
    return FinalizedStep(samples=annotated.take(keep), failures=failures)
