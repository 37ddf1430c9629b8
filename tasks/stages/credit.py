"""Credit: what a rollout's per-token credit is, wherever it came from.

A rollout's credit is of one of two kinds (docs/integrators.md, "Credit"):
- given: the producer's algorithm assigned it per token (the rollout's `advantages` array),
  shipped as given; rlship computes no baseline for it;
- group baseline: rlship computes one advantage for the rollout when its group completes
  (reward minus the group mean, orchestrator.groups) and broadcasts it over its tokens.

Either way a token's rl weight is prime-rl's (its trainer reads an absent stream as 1.0 on
the loss mask; its train sink zeroes the weight of a loss token whose advantage is zero): the
given `rl_weights` or else the loss mask, zero on every loss token of zero advantage. A
rollout with no loss token of non-zero weight left has nothing to train and is pruned.

The producer sums a given credit up (`GivenCredit`) where it has the arrays, and sends the
summary beside the record in the rollout stream: the orchestrator decides the rollout's fate
and the workers its trainable tokens from it, reading no array.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

GIVEN = "given"
GROUP_BASELINE = "group_baseline"
# The cohort column of a rollout with given credit: its tokens that train (NaN: group baseline).
CREDIT_TOKENS_COLUMN = "credit_tokens"


def token_rl_weights(arrays: Mapping[str, Any], advantage: float | None = None) -> np.ndarray:
    """Per-token rl weight of a rollout: its `rl_weights` if given, else 1.0 on its loss
    tokens; 0 on every loss token whose advantage (its own per token, else `advantage`
    broadcast) is zero."""
    loss_mask = np.asarray(arrays["loss_mask"], dtype=bool)
    given = arrays.get("rl_weights")
    weights = loss_mask.astype(np.float64) if given is None else np.asarray(given, dtype=np.float64)
    advantages = arrays.get("advantages")
    zero = np.asarray(advantages) == 0.0 if advantages is not None else advantage == 0.0
    return np.where(loss_mask & zero, 0.0, weights)


def count_trainable(arrays: Mapping[str, Any], advantage: float | None = None) -> int:
    """The rollout's loss tokens that keep a non-zero rl weight."""
    loss_mask = np.asarray(arrays["loss_mask"], dtype=bool)
    return int(np.count_nonzero(loss_mask & (token_rl_weights(arrays, advantage) != 0.0)))


@dataclass(frozen=True)
class GivenCredit:
    """The summary of a rollout's given per-token credit: its loss tokens that train (non-zero
    advantage and rl weight), and its advantage's mean over its loss tokens (what the step's
    `advantage` statistics observe of it; 0 without a loss token)."""

    trainable_tokens: int
    mean_advantage: float

    @classmethod
    def of(cls, arrays: Mapping[str, Any]) -> GivenCredit | None:
        """The summary of checked arrays; None when they carry no `advantages` (group baseline)."""
        if "advantages" not in arrays:
            return None
        loss_mask = np.asarray(arrays["loss_mask"], dtype=bool)
        advantages = np.asarray(arrays["advantages"], dtype=np.float64)
        mean = float(advantages[loss_mask].mean()) if loss_mask.any() else 0.0
        return cls(count_trainable(arrays), mean)

    def to_wire(self) -> str:
        return f"{self.trainable_tokens} {self.mean_advantage!r}"

    @classmethod
    def from_wire(cls, data: bytes | str | None) -> GivenCredit | None:
        """The summary of a stream entry; None when it has none (group baseline). One that
        does not parse is a producer's bug: ValueError naming it."""
        if not data:
            return None
        text = data.decode() if isinstance(data, bytes) else data
        words = text.split()
        try:
            tokens, mean = int(words[0]), float(words[1])
        except (ValueError, IndexError):
            raise ValueError(f"credit: {text!r:.80} is not '<trainable tokens> <mean advantage>'") from None
        if len(words) != 2 or tokens < 0 or not math.isfinite(mean):
            raise ValueError(f"credit: {text!r:.80} is not '<trainable tokens> <mean advantage>'")
        return cls(tokens, mean)

    def columns(self) -> dict[str, float]:
        return {CREDIT_TOKENS_COLUMN: float(self.trainable_tokens)}


def credit_kinds(credit_tokens: np.ndarray) -> np.ndarray:
    """Per cohort row, whether its credit was given (else the group baseline's)."""
    return ~np.isnan(credit_tokens)
