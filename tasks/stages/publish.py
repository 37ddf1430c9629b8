"""Publish: assemble the step's one scalar record from what the stages left behind."""

from __future__ import annotations

from collections.abc import Mapping

# Running totals carried from record to record (`progress/total_*`).
TOTALS: tuple[str, ...] = ("tokens", "input_tokens", "output_tokens", "rollouts", "tasks")


def running_totals(previous: Mapping[str, float], metrics: Mapping[str, float]) -> dict[str, float]:
    """Totals after this step: the previous totals plus this step's progress, and one step."""
    totals = {name: float(previous.get(name, 0.0)) + metrics[f"progress/{name}"] for name in TOTALS}
    totals["steps"] = float(previous.get("steps", 0.0)) + 1
    return totals


def build_record(
    step: int,
    metrics: Mapping[str, float],
    stage_seconds: Mapping[str, float],
    ship_seconds: float,
    wait_for_policy_seconds: float,
    totals: Mapping[str, float],
) -> dict[str, float]:
    """The combined all/effective record: metrics, timings, running totals and `step`."""
    record = dict(metrics)
    for stage, seconds in sorted(stage_seconds.items()):
        record[f"time/{stage}"] = float(seconds)
    record["time/ship"] = float(ship_seconds)
    record["time/wait_for_policy"] = float(wait_for_policy_seconds)
    for name, value in totals.items():
        record[f"progress/total_{name}"] = float(value)
    record["step"] = float(step)
    return record
