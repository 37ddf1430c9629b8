"""Admission: what a run lets its producers write, decided with the write itself.

A run bounds what its producers may have outstanding (`max_outstanding_rollouts`), what the
policy gate will let it train soon, the bytes it holds (`max_held_bytes`), and what is
already stale; a finished run takes nothing. `Admission` holds those limits, and the
producers' script (orchestrator.producer) applies them in the same step as the write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.records import RolloutRecord
from orchestrator.settings import RunSettings
from transport.numbering import required_version, version_after

# A producer's call: each rollout's record and its arrays (name to array, or segments).
Rollouts = list[tuple[RolloutRecord, Mapping[str, Any]]]


class AdmissionRefused(RuntimeError):
    """A call the run does not admit; nothing of it was written. `reason`: backlog, gate_held
    or bytes (it passes: `produce(..., timeout=...)` waits), would_be_stale, too_large or
    finished (it never passes)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"produce refused ({reason}): {message}")
        self.reason = reason

    @property
    def passes(self) -> bool:
        """Whether waiting cures it (backlog, gate held, bytes held): the run admits the call
        once it has room."""
        return self.reason in PASSING_REFUSALS


PASSING_REFUSALS = frozenset({"backlog", "gate_held", "bytes"})
FINISHED = "finished"  # a run that shipped every step takes no more rollouts


@dataclass(frozen=True)
class Admission:
    """What a run admits from its producers: no more outstanding rollouts than its limit,
    none beyond what the policy gate lets it train soon, and none already stale."""

    limit: int
    batch_size: int
    group_size: int  # the run's largest
    first_step: int
    start_step: int
    max_async_level: int
    max_off_policy_steps: int
    max_held_bytes: int = 0  # 0: no byte budget

    @classmethod
    def for_run(cls, settings: RunSettings) -> Admission:
        """The same-named settings; `limit` is the backlog the run allows (`outstanding_limit`)."""
        return cls(
            **settings.values_for(
                cls, limit=settings.outstanding_limit, group_size=settings.largest_group_size
            )
        )

    @property
    def largest_call(self) -> int:
        """Rollouts one call may hold: a batch (or a group, if larger), within the limit."""
        return min(self.limit, max(self.batch_size, self.group_size))

    def gate_room(self, version: int, next_step: int) -> int:
        """The backlog the gate leaves room for: a batch for each step it lets the run cut
        from `next_step` on at policy `version`, and one more, so that the next step to open
        finds its batch ready; and one call less a rollout on top, so that a batch one short
        (some rollouts of a group are discarded) can always be completed. While the gate
        holds, nothing more is admitted once a batch is pending."""
        required = required_version(next_step, self.first_step, self.max_async_level)
        steps = max(0, version - required + 1)
        return (steps + 1) * self.batch_size + self.largest_call - 1

    def refuse_oversize(self, rollouts: Rollouts, sizes: list[int]) -> None:
        """A rollout, a call or a step (a batch of rollouts like these) larger than the byte
        budget could never be admitted: refused at once, naming its size and the budget."""
        budget = self.max_held_bytes
        if budget <= 0 or not sizes:  # an empty call holds nothing
            return
        tail = f"more than the run's budget of {budget:,} bytes (max_held_bytes)"
        for (record, _), size in zip(rollouts, sizes, strict=True):
            if size > budget:
                raise AdmissionRefused(
                    "too_large",
                    f"rollout {record.rollout_id!r} holds {size:,} bytes (blob and rows files), {tail}",
                )
        if sum(sizes) > budget:
            raise AdmissionRefused(
                "too_large", f"this call of {len(sizes)} rollouts holds {sum(sizes):,} bytes, {tail}"
            )
        step = self.batch_size * sum(sizes) // len(sizes)
        if step > budget:
            raise AdmissionRefused(
                "too_large",
                f"a step of {self.batch_size} rollouts like these holds about {step:,} bytes, {tail}",
            )

    def oldest_fresh_version(self, next_step: int) -> int:
        """The oldest policy version that is not stale at `next_step`, the earliest step a
        rollout produced now can ship in (`staleness`, the orchestrator's rule)."""
        return version_after(next_step, self.first_step) - 1 - self.max_off_policy_steps


@dataclass(frozen=True)
class GateView:
    """What a producer read of the run before its call: admission's arguments."""

    version: int
    next_step: int
    room: int
    next_step_read: str  # as read ('' if unset): the script admits only while it stands
