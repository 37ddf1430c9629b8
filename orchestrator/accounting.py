"""What the orchestrator knows of every rollout it has seen: the row of scalars a rollout
becomes once its group is decided, and the counts that must add up at every cut."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from orchestrator.groups import TRAINABLE, Outcome
from orchestrator.records import RolloutRecord, TraceCounts
from tasks.cohort import TRACE_PREFIX
from tasks.stages.credit import GivenCredit
from tasks.stages.finalize import PayloadFacts

EMPTY_STEP = "empty_step"  # the discard reason of the rollouts of a cut the workers emptied


def outcome_row(
    outcome: Outcome, facts: PayloadFacts | None = None, credit: GivenCredit | None = None
) -> tuple[dict[str, float], dict[str, str], dict[str, float]]:
    """A rollout's scalar observations: numeric columns (with its producer's facts and
    summary of its own credit, if it came with them), labels, custom metrics."""
    r: RolloutRecord = outcome.record
    numeric = {
        "reward": r.reward,
        "advantage": outcome.advantage,
        "num_input_tokens": r.num_input_tokens,
        "num_output_tokens": r.num_output_tokens,
        "num_turns": r.num_turns,
        "temperature": r.temperature,
        "policy_version": r.policy_version,
        "is_truncated": float(r.is_truncated),
        "is_trainable": float(outcome.fate == TRAINABLE),
        "has_error": float(r.error is not None),
        "cancelled": float(r.cancelled),
        **(facts.columns() if facts is not None else {}),
        **(credit.columns() if credit is not None else {}),
        **(trace_columns(r.trace) if r.trace is not None else {}),
    }
    labels = {
        "rollout_id": r.rollout_id,
        "env": r.env,
        "group_id": r.group_id,
        "task_id": r.task_id,
        "error": r.error or "",
        "stop_condition": r.stop_condition or "",
        "agent": r.agent or "",
        "episode_id": r.episode_id or "",
        "trace_id": r.trace.id if r.trace is not None else "",
        **(facts.labels() if facts is not None else {}),
    }
    return numeric, labels, r.metrics


def trace_columns(trace: TraceCounts) -> dict[str, float]:
    """The counts of the trace a rollout is a branch of, as optional numeric columns."""
    return {TRACE_PREFIX + name: float(value) for name, value in trace.model_dump(exclude={"id"}).items()}


@dataclass
class Accounting:
    """Counts since the run started. At every cut:
    arrived = rejected + discarded + cut + pending + in open groups; the finalizer splits
    `cut` into shipped and dropped by workers."""

    arrived: int = 0
    cut: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    discarded: Counter[str] = field(default_factory=Counter)
    stale_in_window: int = 0
    # Cuts whose every rollout the workers dropped (the step number is cut again): in the
    # whole run, and in a row since the last cut that shipped.
    empty_steps: int = 0
    empty_in_a_row: int = 0
    # The rollouts of those cuts by the field the workers dropped them for: no record of
    # their own says why, so every later record does.
    empty_dropped: Counter[str] = field(default_factory=Counter)
    # Groups their producers cancelled (`cancel_group`); their rollouts count as discarded
    # (`cancelled`).
    cancelled_groups: int = 0

    def discard(self, reason: str, count: int = 1) -> None:
        self.discarded[reason] += count
        if reason == "stale":
            self.stale_in_window += count

    def empty_cut(self, count: int, dropped: dict[str, int]) -> None:
        """A cut whose every rollout the workers dropped (`dropped`: by field): its rollouts
        count as discarded (reason `empty_step`), not cut, and its step number is cut again."""
        self.empty_dropped.update(dropped)
        self.cut -= count
        self.discard(EMPTY_STEP, count)
        self.empty_steps += 1
        self.empty_in_a_row += 1

    def to_wire(self) -> dict[str, Any]:
        return {
            "arrived": self.arrived,
            "cut": self.cut,
            "rejected": dict(self.rejected),
            "discarded": dict(self.discarded),
            "stale_in_window": self.stale_in_window,
            "empty_steps": self.empty_steps,
            "empty_in_a_row": self.empty_in_a_row,
            "empty_dropped": dict(self.empty_dropped),
            "cancelled_groups": self.cancelled_groups,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Accounting:
        return cls(
            arrived=data["arrived"],
            cut=data["cut"],
            rejected=Counter(data["rejected"]),
            discarded=Counter(data["discarded"]),
            stale_in_window=data["stale_in_window"],
            empty_steps=data.get("empty_steps", 0),
            empty_in_a_row=data.get("empty_in_a_row", 0),
            empty_dropped=Counter(data.get("empty_dropped", {})),
            cancelled_groups=data.get("cancelled_groups", 0),
        )

    @property
    def accounted(self) -> int:
        """Rollouts that left the orchestrator: rejected, discarded or cut."""
        return sum(self.rejected.values()) + sum(self.discarded.values()) + self.cut

    def snapshot(self, pending: int, in_open_groups: int) -> dict[str, float]:
        """The accounting section of the manifest; starts a new window for stale drops."""
        stale, self.stale_in_window = self.stale_in_window, 0
        out = {
            "off_policy/stale_dropped": float(stale),
            "accounting/arrived": float(self.arrived),
            "accounting/cut": float(self.cut),
            "accounting/pending": float(pending),
            "accounting/in_open_groups": float(in_open_groups),
            "accounting/rejected": float(sum(self.rejected.values())),
            "accounting/discarded": float(sum(self.discarded.values())),
            "accounting/cancelled_groups": float(self.cancelled_groups),
            "empty_step/total": float(self.empty_steps),
            "empty_step/consecutive": float(self.empty_in_a_row),
        }
        out.update({f"ingest/rejected/{k}": float(v) for k, v in self.rejected.items()})
        out.update({f"accounting/discarded/{k}": float(v) for k, v in self.discarded.items()})
        out.update({f"empty_step/dropped/{k}": float(v) for k, v in self.empty_dropped.items()})
        return out
