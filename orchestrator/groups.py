"""Groups: rollouts of one task are scored against each other. A group completes when
its env's `group_size` rollouts have arrived (one size for every env, or one per env; a
group of episodes: the `group_rollouts` its records say); its
advantages are computed then, and every rollout learns its fate at once: trainable, or
discarded with a reason (so its payload can be released immediately).

A rollout's credit is decided per rollout (tasks.stages.credit): one that came with its
own per-token advantages (`GivenCredit`) keeps them and takes no part in the group's
baseline; the others' advantage is their reward minus the mean of theirs (prime-rl's GRPO,
optionally length-shaped: `LengthPenalty`). A group may mix both kinds."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.records import RecordRejected, RolloutRecord
from tasks.stages.credit import GIVEN, GROUP_BASELINE, GivenCredit
from tasks.stages.prune import has_training_signal
from transport.numbering import staleness

TRAINABLE = "trainable"
CANCELLED = "cancelled"  # the discard reason of a rollout cancelled by its producer


@dataclass(frozen=True)
class Outcome:
    record: RolloutRecord
    advantage: float  # the group baseline's, or a given credit's mean over its loss tokens
    fate: str  # TRAINABLE or the discard reason: error, cancelled, stale, zero_advantage
    credit: str = GROUP_BASELINE  # or GIVEN


class LengthPenalty(BaseModel):
    """prime-rl's linear length penalty on the GRPO baseline: each reward loses the group's
    mean reward times the weighted sum of its output tokens, input tokens and turns, each
    over the group's largest (at least 1); a weight of 0 turns its term off."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    num_output_tokens_weight: float = Field(default=0.25, ge=0)
    num_input_tokens_weight: float = Field(default=0.1, ge=0)
    num_turns_weight: float = Field(default=0.1, ge=0)

    def shaped(self, records: Sequence[RolloutRecord], rewards: np.ndarray) -> np.ndarray:
        """The rewards less their length penalty."""

        def share(values: list[int]) -> np.ndarray:
            column = np.array(values, dtype=np.float64)
            return column / max(float(column.max()), 1.0)

        fraction = (
            self.num_output_tokens_weight * share([r.num_output_tokens for r in records])
            + self.num_input_tokens_weight * share([r.num_input_tokens for r in records])
            + self.num_turns_weight * share([r.num_turns for r in records])
        )
        return rewards - rewards.mean() * fraction


def group_advantages(rewards: np.ndarray, normalize: bool = False) -> np.ndarray:
    """Reward minus the group mean (optionally over the group std). A group whose rewards
    are all equal has exactly zero advantage, whatever rounding the mean would give."""
    if len(rewards) == 0 or np.all(rewards == rewards[0]):
        return np.zeros(len(rewards))
    advantages = rewards - rewards.mean()
    if normalize:
        advantages = advantages / (rewards.std() + 1e-8)
    return advantages


def decide_group(
    records: list[RolloutRecord],
    next_step: int,
    max_off_policy_steps: int,
    normalize: bool = False,
    first_step: int = 0,
    given: Mapping[str, GivenCredit] | None = None,
    length_penalty: LengthPenalty | None = None,
) -> list[Outcome]:
    """The fate of every rollout of a completed group, stale meaning more than
    `max_off_policy_steps` off-policy if trained at `next_step` (numbered from `first_step`).
    Errored and cancelled rollouts, and those with credit of their own (`given`, by rollout
    id), take no part in the advantage baseline; one of the latter trains if a loss token
    of its keeps a non-zero advantage and rl weight."""
    given = given or {}
    scored = [r for r in records if r.error is None and not r.cancelled and r.rollout_id not in given]
    advantages = dict(
        zip(
            (r.rollout_id for r in scored),
            group_advantages(_scored_rewards(scored, length_penalty), normalize),
            strict=True,
        )
    )
    outcomes = []
    for record in records:
        credit = given.get(record.rollout_id)
        advantage = credit.mean_advantage if credit else float(advantages.get(record.rollout_id, 0.0))
        if record.error is not None:
            fate = "error"
        elif record.cancelled:
            fate = CANCELLED
        elif staleness(next_step, record.policy_version, first_step) > max_off_policy_steps:
            fate = "stale"
        elif not _trains(credit, advantage, record.num_output_tokens):
            fate = "zero_advantage"
        else:
            fate = TRAINABLE
        outcomes.append(Outcome(record, advantage, fate, GIVEN if credit else GROUP_BASELINE))
    return outcomes


def _trains(credit: GivenCredit | None, advantage: float, num_output_tokens: int) -> bool:
    """Whether a rollout has a training signal: a loss token of its own credit that trains,
    else a non-zero group advantage and output tokens."""
    if credit is not None:
        return credit.trainable_tokens > 0
    return has_training_signal(advantage, num_output_tokens)


def _scored_rewards(records: Sequence[RolloutRecord], length_penalty: LengthPenalty | None) -> np.ndarray:
    """The rewards the baseline is taken over: length-shaped, if the run asks."""
    rewards = np.array([r.reward for r in records], dtype=np.float64)
    if not len(rewards) or length_penalty is None:
        return rewards
    return length_penalty.shaped(records, rewards)


class RecentSet:
    """Membership over the last `capacity` items added: duplicate checks in bounded memory."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[object, None] = OrderedDict()

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def add(self, item: object) -> None:
        self._items[item] = None
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)


class GroupBuffer:
    """Open groups by (env, group_id), with the duplicate and overflow checks. Completed
    groups and rollout ids are remembered over a bounded horizon only."""

    def __init__(self, group_size: int | Mapping[str, int], memory: int = 1 << 16) -> None:
        self.group_size = group_size
        self._open: dict[tuple[str, str], list[RolloutRecord]] = {}
        self._seen = RecentSet(memory)
        self._completed = RecentSet(memory)
        self._cancelled = RecentSet(memory)

    def __len__(self) -> int:
        return sum(len(g) for g in self._open.values())

    def add(self, record: RolloutRecord) -> list[RolloutRecord] | None:
        """Add a rollout; return its group when this rollout completes it."""
        if record.rollout_id in self._seen:
            raise RecordRejected("duplicate_rollout", f"rollout_id: {record.rollout_id!r} already received")
        size = record.group_rollouts or group_size_of(self.group_size, record.env)
        key = (record.env, record.group_id)
        if key in self._cancelled:
            raise RecordRejected(
                "group_cancelled",
                f"group_id: {record.group_id!r} of env {record.env!r} was cancelled by its producer",
            )
        if key in self._completed:
            raise RecordRejected(
                "group_overflow",
                f"group_id: {record.group_id!r} of env {record.env!r} already has {size} rollouts",
            )
        group = self._open.setdefault(key, [])
        group.append(record)
        self._seen.add(record.rollout_id)
        if len(group) < size:
            return None
        del self._open[key]
        self._completed.add(key)
        return group

    def cancel(self, env: str, group_id: str) -> list[RolloutRecord] | None:
        """Cancel a group its producer gave up on: its rollouts arrived so far (to discard),
        and any that arrive later are rejected (`group_cancelled`); None if it had completed
        already (its fates are decided)."""
        key = (env, group_id)
        if key in self._completed:
            return None
        self._cancelled.add(key)
        return self._open.pop(key, [])


def group_size_of(group_size: int | Mapping[str, int], env: str) -> int:
    """The size of `env`'s groups: the run's one size, or its env's (RecordRejected
    `unknown_env` for an env the mapping does not name)."""
    if isinstance(group_size, int):
        return group_size
    if env not in group_size:
        raise RecordRejected(
            "unknown_env", f"env: {env!r} has no size in the run's group_size {dict(group_size)}"
        )
    return group_size[env]
