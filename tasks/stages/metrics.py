"""Metrics: the step's statistics over `all` (every rollout finalized since the previous
cut, whatever became of it) and `effective` (exactly the rollouts shipped in this step).

Keys follow `train/{scope}/{subset}/{name}/{stat}` (docs/metrics.md): the statistics of
`record_names` `rlship-1`; under `prime-rl-559b447`, tasks.stages.names_559b447 computes
them instead, and this module the keys both schemes share. A rollout whose
producer gave its credit per token is observed in `advantage` by the mean of its advantages
over its loss tokens (tasks.stages.credit). Every
observation of the window is kept, so percentiles are exact (numpy's linear
interpolation between closest ranks); rates keep their denominators as `.../count`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import numpy as np

from tasks.cohort import CUSTOM_PREFIX, Cohort
from tasks.manifest import StepManifest
from tasks.stages import names_559b447, prime_names, record_names
from tasks.stages.credit import CREDIT_TOKENS_COLUMN, GIVEN, GROUP_BASELINE, credit_kinds
from tasks.stages.prune import drop_field

DISTRIBUTIONS: tuple[str, ...] = (
    "reward",
    "advantage",
    "num_total_tokens",
    "num_input_tokens",
    "num_output_tokens",
    "num_turns",
)
STATS: tuple[str, ...] = ("mean", "min", "max", "p10", "p50", "p90")
RATES_BOTH: tuple[str, ...] = ("is_truncated", "is_trainable")
RATES_ALL_ONLY: tuple[str, ...] = ("has_error", "cancelled")
SOLVED_REWARD = 1.0


def distribution(values: np.ndarray) -> dict[str, float]:
    """mean, min, max, p10, p50, p90 of the finite observations (empty dict if none)."""
    values = values[~np.isnan(values)]
    if not len(values):
        return {}
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return dict(
        zip(STATS, map(float, (values.mean(), values.min(), values.max(), p10, p50, p90)), strict=True)
    )


def _column(cohort: Cohort, name: str) -> np.ndarray:
    return cohort.total_tokens() if name == "num_total_tokens" else cohort.numeric[name]


def _group_solved_shares(cohort: Cohort) -> dict[str, float]:
    """Share of groups in which none, some or all rollouts solved the task (NaN for an
    empty cohort, whose record keeps the same keys)."""
    solved_by_group = [[reward >= SOLVED_REWARD for reward in group] for group in cohort.rewards_by_group()]
    groups = len(solved_by_group)
    if not groups:
        return {"num_groups": 0.0, "solved_none": math.nan, "solved_all": math.nan, "solved_some": math.nan}
    none = sum(not any(s) for s in solved_by_group)
    every = sum(all(s) for s in solved_by_group)
    return {
        "num_groups": float(groups),
        "solved_none": none / groups,
        "solved_all": every / groups,
        "solved_some": (groups - none - every) / groups,
    }


def subset_metrics(cohort: Cohort, subset: str) -> dict[str, float]:
    """The statistics of one scope and subset, keyed `{name}/{stat}`. A subset without
    rollouts (an empty window, an env absent from the batch) has count 0 and NaN for every
    statistic of the fixed set, so that every record carries the same keys; a custom
    metric appears where it was observed."""
    out: dict[str, float] = {"count": float(len(cohort))}
    rates = RATES_BOTH + (RATES_ALL_ONLY if subset == "all" else ())
    if not len(cohort):
        out.update({f"{name}/{stat}": math.nan for name in DISTRIBUTIONS for stat in STATS})
        out.update({f"{name}/mean": math.nan for name in rates})
        if subset == "all":
            out.update(_group_solved_shares(cohort))
        return out
    names = [*DISTRIBUTIONS, *(CUSTOM_PREFIX + m for m in cohort.custom_metric_names)]
    for name in names:
        for stat, value in distribution(_column(cohort, name)).items():
            out[f"{name}/{stat}"] = value
    for name in rates:
        out[f"{name}/mean"] = float(cohort.numeric[name].mean())
    if subset == "all":
        for error, count in Counter(e for e in cohort.labels["error"] if e).items():
            out[f"error/{error}"] = float(count)
        for condition, count in Counter(c for c in cohort.labels["stop_condition"] if c).items():
            out[f"stop_condition/{condition}"] = count / len(cohort)
        out.update(_group_solved_shares(cohort))
    return out


def _envs(cohorts: Iterable[Cohort]) -> list[str]:
    return sorted({env for cohort in cohorts for env in cohort.labels["env"]})


def train_metrics(window: Cohort, shipped: Cohort) -> dict[str, float]:
    """`train/{scope}/{subset}/...` for scope agg and every env, subsets all and effective."""
    record: dict[str, float] = {}
    for subset, cohort in (("all", window), ("effective", shipped)):
        scopes = [("agg", cohort)] + [(env, cohort.where("env", env)) for env in _envs([window, shipped])]
        for scope, part in scopes:
            for key, value in subset_metrics(part, subset).items():
                record[f"train/{scope}/{subset}/{key}"] = value
    return record


def credit_counts(shipped: Cohort) -> dict[str, float]:
    """The shipped rollouts by the kind of their credit (tasks.stages.credit): their own
    per-token advantages, or rlship's group baseline."""
    tokens = shipped.numeric.get(CREDIT_TOKENS_COLUMN, np.full(len(shipped), np.nan))
    given = int(np.count_nonzero(credit_kinds(tokens)))
    return {f"credit/{GIVEN}": float(given), f"credit/{GROUP_BASELINE}": float(len(shipped) - given)}


def step_metrics(manifest: StepManifest, shipped: Cohort, dropped_by_workers: list[str]) -> dict[str, float]:
    """Everything of the record the workers compute from the manifest and the shipped cohort.

    `shipped` carries the finalize annotations (`num_tokens`, `staleness`);
    `dropped_by_workers` the reasons of the cut rollouts the workers could not ship. The
    statistics are those of the run's `record_names` (tasks.stages.record_names); the
    progress, credit and staleness keys are rlship's internal ones in both (publish reads
    them, then names the record).
    """
    rlship_1 = manifest.config.record_names == record_names.RLSHIP_1
    if rlship_1:
        record = train_metrics(manifest.window, shipped)
    else:
        statistics = names_559b447.from_step(manifest.window, shipped, manifest.loop_lag_ms)
        record = record_names.pending(statistics)
    input_tokens = float(shipped.numeric["num_input_tokens"].sum())
    output_tokens = float(shipped.numeric["num_output_tokens"].sum())
    record.update(
        {
            "progress/tokens": input_tokens + output_tokens,
            "progress/input_tokens": input_tokens,
            "progress/output_tokens": output_tokens,
            "progress/rollouts": float(len(shipped)),
            "progress/tasks": float(len(set(shipped.labels["task_id"]))),
            "progress/dropped_by_workers": float(len(dropped_by_workers)),
            **credit_counts(shipped),
        }
    )
    for field, count in Counter(drop_field(reason) for reason in dropped_by_workers).items():
        record[f"progress/dropped_by_workers/{field}"] = float(count)
    if len(shipped):
        staleness = shipped.numeric["staleness"]
        record["off_policy/staleness/mean"] = float(staleness.mean())
        record["off_policy/staleness/max"] = float(staleness.max())
        for env, count in Counter(shipped.labels["env"]).items():
            record[f"batch/{env}"] = count / len(shipped)
    # Lag since the previous cut; two cuts closer than one probe period have no sample: 0.
    lag = manifest.loop_lag_ms if len(manifest.loop_lag_ms) else np.zeros(1)
    p50, p99 = np.percentile(lag, [50, 99])
    record.update(
        {
            "event_loop_lag/p50_ms": float(p50),
            "event_loop_lag/p99_ms": float(p99),
            "event_loop_lag/max_ms": float(lag.max()),
            "event_loop_lag/samples": float(len(manifest.loop_lag_ms)),
        }
    )
    if rlship_1:
        record.update(prime_names.from_step(manifest.window, manifest.loop_lag_ms))
    for name, value in manifest.counters.items():
        record[name] = float(value)
    return record
