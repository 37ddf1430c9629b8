"""What a producer checks of a call before anything of it is written: each rollout's arrays
by the workers' own checks against the run's limits (so a rollout the run would drop at the
cut fails where it is made), and the call against the run's groups and envs. Every problem
is named (rollout, field, value) in one `RolloutRejected`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from orchestrator.admission import Rollouts
from orchestrator.groups import group_size_of
from orchestrator.records import RecordRejected
from tasks.stages.finalize import check_rollout_arrays
from transport.arrays_blob import flat_arrays
from transport.payload_segments import ANYWHERE, PAYLOAD_FIELD, SideArrays
from transport.schema import EncodedTensor, SchemaError


class RolloutRejected(ValueError):
    """Rollouts that were not written, each with why (naming the field and the value)."""

    def __init__(self, problems: dict[str, str]) -> None:
        super().__init__("; ".join(f"rollout {rid!r}: {problem}" for rid, problem in problems.items()))
        self.problems = problems


def check_rollouts(
    rollouts: Rollouts,
    max_tokens: int,
    vocab_size: int,
    side_arrays: SideArrays = ANYWHERE,
    problems: Mapping[str, str] | None = None,
) -> list[Mapping[str, Any]]:
    """The workers' own payload checks, run where the bad data is made (the producer), and
    one id given twice in the same call; returns each rollout's checked arrays, or raises
    `RolloutRejected` with these problems and any already found (`problems`)."""
    problems = dict(problems or {})
    checked = []
    seen: set[str] = set()
    for record, arrays in rollouts:
        if record.rollout_id in seen:
            problems[record.rollout_id] = f"rollout_id: {record.rollout_id!r} appears twice in this call"
            continue
        seen.add(record.rollout_id)
        try:
            flat = flat_arrays(arrays)
        except SchemaError as exc:
            problems[record.rollout_id] = str(exc)
            continue
        arrays, problem = _as_numpy(flat)
        if problem is None:
            problem = check_rollout_arrays(arrays, record.num_tokens, max_tokens, vocab_size, side_arrays)
        if problem is not None:
            found = problems.get(record.rollout_id)
            problems[record.rollout_id] = problem if found is None else f"{problem}; {found}"
        checked.append(arrays)
    if problems:
        raise RolloutRejected(problems)
    return checked


def _as_numpy(flat: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Arrays as numpy (mm_kwargs tensors and payload segments as they are), or why one is
    not an array (a ragged list: NumPy refuses to make one)."""
    arrays = {}
    for name, value in flat.items():
        if isinstance(value, EncodedTensor) or name == PAYLOAD_FIELD:
            arrays[name] = value
            continue
        try:
            arrays[name] = np.asarray(value)
        except (ValueError, TypeError) as exc:
            return arrays, f"{name}: not an array ({exc})"
    return arrays, None


def call_problems(
    rollouts: Rollouts,
    group_size: int | Mapping[str, int],
    envs: Collection[str] | None,
    partial_groups: bool,
) -> dict[str, str]:
    """What the run would reject of this call at ingest, by rollout: an env it does not take
    (`unknown_env`: not one of its envs, or one its per-env `group_size` does not size), more
    rollouts of a group than its env's group size (`group_overflow`), and, unless the call
    says its groups come in parts, a group short of it (it would wait in the run's open
    groups until the rest arrives). A group of episodes is sized by the `group_rollouts` its
    records say."""
    problems: dict[str, str] = {}
    sizes = Counter((record.env, record.group_id) for record, _ in rollouts)
    for record, _ in rollouts:
        have = sizes[(record.env, record.group_id)]
        if envs is not None and record.env not in envs:
            problems[record.rollout_id] = f"env: {record.env!r} is not one of the run's envs {sorted(envs)}"
            continue
        try:
            size = record.group_rollouts or group_size_of(group_size, record.env)
        except RecordRejected as exc:
            problems[record.rollout_id] = str(exc)
            continue
        what = (
            "the run's group_size"
            if isinstance(group_size, int)
            else f"the run's group_size for env {record.env!r}"
        )
        what = "its group_rollouts" if record.group_rollouts else what
        if have > size:
            problems[record.rollout_id] = (
                f"group_id: {record.group_id!r} has {have} rollouts in this call, more than {what} {size}"
            )
        elif have < size and not partial_groups:
            problems[record.rollout_id] = (
                f"group_id: {record.group_id!r} has {have} of {what} "
                f"{size} rollouts in this call; write whole groups, or produce(..., "
                "partial_groups=True) to write the rest in later calls"
            )
    return problems
