"""Publish: assemble the step's one scalar record from what the stages left behind, and
check that its accounting adds up before it goes out."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from tasks.stages import record_names

log = logging.getLogger("rlship.publish")

# Running totals carried from record to record (`progress/total_*`).
TOTALS: tuple[str, ...] = (
    "tokens",
    "input_tokens",
    "output_tokens",
    "rollouts",
    "tasks",
    "dropped_by_workers",
)

# Every rollout that ever arrived is in exactly one of these (run totals at this step's cut).
CONSERVATION_TERMS: tuple[str, ...] = (
    "accounting/rejected",
    "accounting/discarded",
    "accounting/shipped",
    "accounting/dropped_by_workers",
    "accounting/pending",
    "accounting/in_open_groups",
)


def conservation_error(record: Mapping[str, float]) -> str | None:
    """Why the record's accounting does not add up, or None when it does."""
    terms = {name: record.get(name, 0.0) for name in CONSERVATION_TERMS}
    arrived = record.get("accounting/arrived", 0.0)
    if arrived != sum(terms.values()):
        parts = " + ".join(f"{name.split('/', 1)[1]} {value:g}" for name, value in terms.items())
        return f"accounting/arrived {arrived:g} != {parts} = {sum(terms.values()):g}"
    return None


def running_totals(previous: Mapping[str, float], metrics: Mapping[str, float]) -> dict[str, float]:
    """Totals after this step: the previous totals plus this step's progress (and, for the
    559b447 record, its window counts), and one step."""
    totals = {name: float(previous.get(name, 0.0)) + metrics[f"progress/{name}"] for name in TOTALS}
    for name, count in record_names.window_progress(metrics).items():
        totals[name] = float(previous.get(name, 0.0)) + count
    totals["steps"] = float(previous.get("steps", 0.0)) + 1
    return totals


def build_record(
    step: int,
    metrics: Mapping[str, float],
    stage_seconds: Mapping[str, float],
    ship_seconds: float,
    wait_for_policy_seconds: float,
    totals: Mapping[str, float],
    names: str,
) -> dict[str, float]:
    """The combined all/effective record: metrics, timings, running totals and `step`,
    named by `names` (tasks.stages.record_names)."""
    record = dict(metrics)
    for stage, seconds in sorted(stage_seconds.items()):
        record[f"time/{stage}"] = float(seconds)
    record["time/ship"] = float(ship_seconds)
    record["time/wait_for_policy"] = float(wait_for_policy_seconds)
    for name, value in totals.items():
        record[f"progress/total_{name}"] = float(value)
    record["accounting/shipped"] = float(totals["rollouts"])
    record["accounting/dropped_by_workers"] = float(totals["dropped_by_workers"])
    record = record_names.name_record(record, names)
    record["step"] = float(step)
    problem = conservation_error(record)
    if problem is not None:
        log.error("step %d: the record's accounting does not add up: %s", step, problem)
    record["accounting/balanced"] = float(problem is None)
    return record
