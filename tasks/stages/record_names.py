"""The record's naming scheme (the `record_names` setting) and what every consumer reads of
a record whichever scheme wrote it.

- `prime-rl-559b447` (the default): prime-rl's orchestrator names at commit 559b447
  (tasks.stages.names_559b447 computes its statistics), beside rlship's own families that
  name nothing of prime-rl's (`accounting/*`, `credit/*`, `time/{stage}`, ...).
- `rlship-1`: the record as rlship wrote it before, rlship's `train/*` statistics and
  prime-rl 0002457f's aliases (tasks.stages.prime_names), for dashboards built on it.

The metrics stage hands the 559b447 statistics to publish under `PENDING`, publish builds
the record from rlship's internal keys (totals and accounting read them) and then names it
(`name_record`). docs/record.md maps each name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from tasks.stages import prime_names

PRIME_RL_559B447 = "prime-rl-559b447"
RLSHIP_1 = "rlship-1"
RecordNames = Literal["prime-rl-559b447", "rlship-1"]
PENDING = "559b447:"  # a statistic of the 559b447 record on its way from metrics to publish
# Run totals carried for the 559b447 record's `progress/total_*`: the window's tokens,
# rollouts and tasks (prime-rl counts its totals over the arrival window).
WINDOW_TOTALS: dict[str, str] = {
    "window_tokens": "progress/tokens",
    "window_rollouts": "progress/rollouts",
    "window_tasks": "progress/tasks",
}
# rlship's internal keys that 559b447 names otherwise (same quantity), or replaces (its
# `progress/input_tokens` and `progress/output_tokens` are rlship's, kept as they are).
RENAMED_559B447: dict[str, str] = {
    "off_policy/staleness/mean": "off_policy/mean",
    "off_policy/staleness/max": "off_policy/max",
    "off_policy/stale_dropped": "off_policy/dropped",
}
REPLACED_559B447: tuple[str, ...] = (
    "progress/tokens",
    "progress/rollouts",
    "progress/tasks",
    "progress/total_tokens",
    "progress/total_rollouts",
    "progress/total_tasks",
    *(f"progress/total_{name}" for name in WINDOW_TOTALS),
)


def pending(statistics: Mapping[str, float]) -> dict[str, float]:
    """The 559b447 statistics as the metrics stage hands them to publish."""
    return {PENDING + name: value for name, value in statistics.items()}


def window_progress(metrics: Mapping[str, float]) -> dict[str, float]:
    """This step's window counts to add to the run totals (none under `rlship-1`)."""
    return {name: metrics[PENDING + key] for name, key in WINDOW_TOTALS.items() if PENDING + key in metrics}


def name_record(record: Mapping[str, float], names: str) -> dict[str, float]:
    """The published record under `names`, from publish's record of rlship's internal keys."""
    if names == RLSHIP_1:
        return {**record, **prime_names.from_record(record)}
    out = {
        RENAMED_559B447.get(key, key): value
        for key, value in record.items()
        if not key.startswith((PENDING, "batch/")) and key not in REPLACED_559B447
    }
    out.update({key[len(PENDING) :]: value for key, value in record.items() if key.startswith(PENDING)})
    for name, key in WINDOW_TOTALS.items():  # prime-rl logs its totals before adding the step
        total = key.replace("progress/", "progress/total_")
        out[total] = record[f"progress/total_{name}"] - record[PENDING + key]
    return out


def shipped_tokens(record: Mapping[str, float]) -> float:
    """Tokens this step shipped (input + output, shipped in both schemes)."""
    return record.get("progress/input_tokens", 0.0) + record.get("progress/output_tokens", 0.0)


def total_shipped_tokens(record: Mapping[str, float]) -> float:
    """Tokens shipped through this step (rlship's own totals, in both schemes)."""
    return record.get("progress/total_input_tokens", 0.0) + record.get("progress/total_output_tokens", 0.0)


def shipped_rollouts(record: Mapping[str, float]) -> float:
    """Rollouts this step shipped: by their credit, which covers each once (both schemes)."""
    return record.get("credit/given", 0.0) + record.get("credit/group_baseline", 0.0)


def staleness_max(record: Mapping[str, float]) -> float | None:
    """How many steps off-policy the step's most stale shipped rollout was, if it shipped any."""
    return record.get("off_policy/max", record.get("off_policy/staleness/max"))


def agg_statistic(record: Mapping[str, float], subset: str, name: str) -> str:
    """Where an `agg` distribution of `subset` is, its `/{stat}` to be appended: rlship-1's
    `train/agg/{subset}/{name}`, 559b447's episode-level one (token counts, turns), or for a
    per-agent one (reward) its only agent's; rlship-1's name when none is in the record."""
    plain = f"train/agg/{subset}/{name}"
    if f"{plain}/mean" in record:
        return plain
    per_agent = [
        key.removesuffix("/mean")
        for key in record
        if key.startswith(f"{plain.rsplit('/', 1)[0]}/")
        and key.endswith(f"/{name}/mean")
        and key.count("/") == 5
    ]
    return per_agent[0] if len(per_agent) == 1 else plain
