"""The rollout log (`rlship run --record-rollouts PATH`): one JSON line per finalized
rollout, written once its fate is known, so anyone can recompute a record from it.

Fields: the rollout's record (ids, env, reward, token counts, flags, custom metrics), its
`advantage` (a given credit's: its mean over the loss tokens), `credit` ("given" or
"group_baseline": tasks.stages.credit), `is_trainable` (the decision when its group
completed), `fate` ("shipped", "discarded", or "unshipped" at the end of the run),
`step` (the step whose `all` statistics count it: the first cut after its group
completed), and `shipped_step`, or `discarded_step` with `reason` (the step whose record
counts the shipment or the drop).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from orchestrator.groups import TRAINABLE, Outcome

UNSHIPPED = "unshipped"


def outcome_line(outcome: Outcome) -> dict[str, Any]:
    return {
        **outcome.record.model_dump(),
        "advantage": outcome.advantage,
        "credit": outcome.credit,
        "is_trainable": outcome.fate == TRAINABLE,
        "fate": None,
        "step": None,
    }


class RolloutLog:
    """Buffers lines until their steps are known; a no-op when `path` is None."""

    def __init__(self, path: Path | None) -> None:
        self._sink: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._sink = path.open("a")
        self._window: dict[str, tuple[dict[str, Any], str]] = {}
        self._awaiting: dict[str, dict[str, Any]] = {}

    @property
    def enabled(self) -> bool:
        return self._sink is not None

    def _write(self, line: dict[str, Any]) -> None:
        assert self._sink is not None
        self._sink.write(json.dumps(line, sort_keys=True) + "\n")

    def finalized(self, outcome: Outcome) -> None:
        """A rollout whose group completed: it belongs to the window of the next cut."""
        if self.enabled:
            self._window[outcome.record.rollout_id] = (outcome_line(outcome), outcome.fate)

    def cut(self, step: int) -> None:
        """Step `step` was cut: its window's discarded rollouts are final now."""
        if not self.enabled:
            return
        for line, fate in self._window.values():
            line["step"] = step
            if fate == TRAINABLE:
                self._awaiting[line["rollout_id"]] = line
            else:
                self._write({**line, "fate": "discarded", "reason": fate, "discarded_step": step})
        self._window.clear()

    def dropped_at_cut(self, rollout_ids: list[str], step: int, reason: str) -> None:
        """Pending rollouts discarded at the cut of step `step` (gone stale while waiting).
        One from the current window is written with the window, when `step` is cut."""
        for rollout_id in rollout_ids if self.enabled else []:
            if rollout_id in self._window:
                self._window[rollout_id] = (self._window[rollout_id][0], reason)
            else:
                line = self._awaiting.pop(rollout_id)
                self._write({**line, "fate": "discarded", "reason": reason, "discarded_step": step})

    def shipped(self, step: int, rollout_ids: list[str], dropped: dict[str, str]) -> None:
        """Step `step` was published: its rollouts shipped, except those the workers dropped."""
        for rollout_id in rollout_ids if self.enabled else []:
            line = self._awaiting.pop(rollout_id)
            if rollout_id in dropped:
                reason = dropped[rollout_id]
                self._write({**line, "fate": "discarded", "reason": reason, "discarded_step": step})
            else:
                self._write({**line, "fate": "shipped", "shipped_step": step})

    def close(self) -> None:
        """At the end of the run: what never shipped, and the window no record counted."""
        if self._sink is None:
            return
        for line in self._awaiting.values():
            self._write({**line, "fate": UNSHIPPED})
        for line, fate in self._window.values():
            if fate == TRAINABLE:
                self._write({**line, "fate": UNSHIPPED})
            else:
                self._write({**line, "fate": "discarded", "reason": fate, "discarded_step": None})
        self._sink.close()
        self._sink = None
