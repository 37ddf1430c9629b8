"""Groups: rollouts of one task are scored against each other. A group completes when
`group_size` rollouts have arrived (or the `group_rollouts` its records say: a group of
episodes); its advantages are computed then, and every rollout
learns its fate at once: trainable, or discarded with a reason (so its payload can be
released immediately)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from orchestrator.records import RecordRejected, RolloutRecord
from tasks.stages.prune import has_training_signal
from transport.numbering import staleness

TRAINABLE = "trainable"


@dataclass(frozen=True)
class Outcome:
    record: RolloutRecord
    advantage: float
    fate: str  # TRAINABLE or the discard reason: error, cancelled, stale, zero_advantage


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
) -> list[Outcome]:
    """The fate of every rollout of a completed group, stale meaning more than
    `max_off_policy_steps` off-policy if trained at `next_step` (numbered from `first_step`).
    Errored and cancelled rollouts take no part in the advantage baseline."""
    scored = [r for r in records if r.error is None and not r.cancelled]
    advantages = dict(
        zip(
            (r.rollout_id for r in scored),
            group_advantages(np.array([r.reward for r in scored], dtype=np.float64), normalize),
            strict=True,
        )
    )
    outcomes = []
    for record in records:
        advantage = float(advantages.get(record.rollout_id, 0.0))
        if record.error is not None:
            fate = "error"
        elif record.cancelled:
            fate = "cancelled"
        elif staleness(next_step, record.policy_version, first_step) > max_off_policy_steps:
            fate = "stale"
        elif not has_training_signal(advantage, record.num_output_tokens):
            fate = "zero_advantage"
        else:
            fate = TRAINABLE
        outcomes.append(Outcome(record, advantage, fate))
    return outcomes


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

    def __init__(self, group_size: int, memory: int = 1 << 16) -> None:
        self.group_size = group_size
        self._open: dict[tuple[str, str], list[RolloutRecord]] = {}
        self._seen = RecentSet(memory)
        self._completed = RecentSet(memory)

    def __len__(self) -> int:
        return sum(len(g) for g in self._open.values())

    def add(self, record: RolloutRecord) -> list[RolloutRecord] | None:
        """Add a rollout; return its group when this rollout completes it."""
        if record.rollout_id in self._seen:
            raise RecordRejected("duplicate_rollout", f"rollout_id: {record.rollout_id!r} already received")
        key = (record.env, record.group_id)
        if key in self._completed:
            raise RecordRejected(
                "group_overflow",
                f"group_id: {record.group_id!r} of env {record.env!r} already has "
                f"{record.group_rollouts or self.group_size} rollouts",
            )
        group = self._open.setdefault(key, [])
        group.append(record)
        self._seen.add(record.rollout_id)
        if len(group) < (record.group_rollouts or self.group_size):
            return None
        del self._open[key]
        self._completed.add(key)
        return group
