"""Prune: a token with zero advantage carries no policy-gradient signal, so it loses its rl
weight; a sample left with no weighted loss token has nothing to train and is dropped
before packing (it would cost tokens on every rank for nothing)."""

from __future__ import annotations

import numpy as np

from tasks.cohort import Cohort

NO_TRAINABLE_TOKENS = "no_trainable_tokens"
INVALID_PAYLOAD = "invalid_payload"


def drop_reason(problem: str | None) -> str:
    """How a worker drop is logged: why finalize refused the payload, or the prune rule."""
    return NO_TRAINABLE_TOKENS if problem is None else f"{INVALID_PAYLOAD}: {problem}"


def worker_drops(failures: dict[str, str], pruned: list[str]) -> dict[str, str]:
    """Every cut rollout the workers will not ship, with its logged reason."""
    drops = {rollout_id: drop_reason(problem) for rollout_id, problem in failures.items()}
    drops.update(dict.fromkeys(pruned, drop_reason(None)))
    return drops


def drop_field(reason: str) -> str:
    """The short label a drop is counted under: the offending field, or the prune rule."""
    return reason.split(": ")[1].split(":")[0] if reason.startswith(INVALID_PAYLOAD) else reason


def has_training_signal(advantage: float, num_output_tokens: float) -> bool:
    """Whether a rollout can train at all: the orchestrator's test at group completion."""
    return advantage != 0.0 and num_output_tokens > 0


def trainable_tokens(loss_tokens: np.ndarray, advantage: np.ndarray) -> np.ndarray:
    """The tokens that train, per rollout: its loss tokens, unless its advantage is zero."""
    return np.where(advantage == 0.0, 0.0, loss_tokens)


def count_trainable_tokens(loss_mask: np.ndarray, advantage: float) -> int:
    return int(trainable_tokens(np.count_nonzero(loss_mask), advantage))


def prune_samples(samples: Cohort) -> tuple[Cohort, list[str]]:
    """Keep the samples with at least one trainable token; return them and the dropped ids."""
    keep = samples.numeric["trainable_tokens"] > 0
    dropped = [rid for rid, kept in zip(samples.labels["rollout_id"], keep, strict=True) if not kept]
    return samples.take(keep), dropped
