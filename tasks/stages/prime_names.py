"""prime-rl's metric names: every quantity prime-rl's orchestrator logs that rlship also
knows, under prime-rl's name and with its meaning, so a prime-rl dashboard reads an rlship
run unchanged. rlship's own keys stay beside them.

Reference: prime-rl `src/prime_rl/orchestrator/orchestrator.py` (the `to_log` dict, commit
0002457f), its scheduler's `get_metrics` (`scheduler/cancelled_rollouts`,
`errored_rollouts/*`) and `event_loop_lag.py`. prime-rl's step batch is every rollout
generated for the step, errored and zero-advantage ones included (it filters nothing
before the trainer); rlship discards those before shipping, so prime-rl's batch statistics
are computed over rlship's `all` subset (every rollout finalized since the previous cut)
and its progress counts (what was sent to the trainer) come from the shipped step. Its
per-example statistics group by `example_id`: here, a task of an env. docs/metrics.md's table lists
each name, its meaning, its rlship source, and what rlship does not have.

Two pure functions: `from_step` (in the metrics stage, from the step's `all` cohort and the
event-loop lag samples) and `from_record` (in publish, from keys only the record holds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from tasks.cohort import CUSTOM_PREFIX, Cohort

# prime-rl name -> rlship record key, same quantity (publish time: totals and waits are there).
RECORD_ALIASES: dict[str, str] = {
    "progress/samples": "progress/rollouts",
    "progress/problems": "progress/tasks",
    "progress/prefill_tokens": "progress/input_tokens",
    "progress/decode_tokens": "progress/output_tokens",
    "progress/total_samples": "progress/total_rollouts",
    "progress/total_problems": "progress/total_tasks",
    "time/wait_for_ckpt": "time/wait_for_policy",
    "scheduler/cancelled_rollouts": "off_policy/stale_dropped",
}
# prime-rl name -> the cohort column averaged per example, then summarized over examples.
PER_EXAMPLE: dict[str, str] = {
    "seq_len": "num_total_tokens",
    "prefill_len": "num_input_tokens",
    "decode_len": "num_output_tokens",
    "is_truncated": "is_truncated",
    "num_turns": "num_turns",
}


def from_record(record: Mapping[str, float]) -> dict[str, float]:
    """prime-rl names of quantities the record already holds under rlship's names."""
    return {name: float(record[source]) for name, source in RECORD_ALIASES.items() if source in record}


def _per_example_means(cohort: Cohort, column: np.ndarray) -> np.ndarray:
    """The mean of `column` per example (prime-rl's `groupby("example_id").mean()`); an
    example is a task of an env."""
    examples = [
        f"{env}\0{task}" for env, task in zip(cohort.labels["env"], cohort.labels["task_id"], strict=True)
    ]
    _, example_of = np.unique(np.asarray(examples), return_inverse=True)
    return np.bincount(example_of, weights=column) / np.bincount(example_of)


def _solve_shares(cohort: Cohort) -> dict[str, float]:
    """prime-rl's solve_all / solve_none: problems (groups) whose rewards sum to the number
    of their rollouts (all solved) or to 0 (none solved)."""
    groups = cohort.rewards_by_group()
    solve_all = float(np.mean([sum(r) == len(r) for r in groups]))
    solve_none = float(np.mean([sum(r) == 0 for r in groups]))
    return {
        "batch/solve_none": solve_none,
        "batch/solve_all": solve_all,
        "batch/effective_batch_size": 1 - solve_none - solve_all,
    }


def from_step(window: Cohort, loop_lag_ms: np.ndarray) -> dict[str, float]:
    """prime-rl's batch statistics over the step's `all` rollouts (NaN when there are none,
    so every record has the same keys) and its event-loop lag statistics, in seconds, over
    the lag samples since the previous cut."""
    lag = np.asarray(loop_lag_ms, dtype=np.float64) / 1000.0 if len(loop_lag_ms) else np.zeros(1)
    out = {
        "event_loop_lag/min": float(lag.min()),
        "event_loop_lag/mean": float(lag.mean()),
        "event_loop_lag/med": float(np.median(lag)),
        "event_loop_lag/p90": float(np.percentile(lag, 90)),
        "event_loop_lag/max": float(lag.max()),
    }
    if not len(window):
        fixed = [f"{name}/{stat}" for name in PER_EXAMPLE for stat in ("mean", "max", "min")]
        fixed += [f"reward/{stat}" for stat in ("mean", "std", "min", "max", "median")]
        fixed += ["batch/solve_none", "batch/solve_all", "batch/effective_batch_size", "error/mean"]
        fixed += ["errored_rollouts/all"]
        return out | dict.fromkeys(fixed, math.nan)
    for name, source in PER_EXAMPLE.items():
        column = window.total_tokens() if source == "num_total_tokens" else window.numeric[source]
        means = _per_example_means(window, column)
        for stat, value in (("mean", means.mean()), ("max", means.max()), ("min", means.min())):
            out[f"{name}/{stat}"] = float(value)
    reward = window.numeric["reward"]
    out.update(
        {
            "reward/mean": float(reward.mean()),
            "reward/std": float(reward.std(ddof=1)) if len(reward) > 1 else math.nan,
            "reward/min": float(reward.min()),
            "reward/max": float(reward.max()),
            "reward/median": float(np.median(reward)),
        }
    )
    out.update(_solve_shares(window))
    errors = [e for e in window.labels["error"] if e]
    out["error/mean"] = out["errored_rollouts/all"] = len(errors) / len(window)
    for env in dict.fromkeys(window.labels["env"]):
        of_env = [e for e, x in zip(window.labels["error"], window.labels["env"], strict=True) if x == env]
        out[f"errored_rollouts/{env}"] = sum(map(bool, of_env)) / len(of_env)
    for error in dict.fromkeys(errors):
        out[f"error/{error}"] = errors.count(error) / len(errors)
    for name in window.custom_metric_names:
        values = window.numeric[CUSTOM_PREFIX + name]
        if not np.isnan(values).all():
            out[f"metrics/{name}"] = float(np.nanmean(values))
    envs = list(dict.fromkeys(window.labels["env"]))
    if len(envs) > 1:  # as prime-rl: per-env reward only with more than one env
        labels = np.asarray(window.labels["env"])
        out.update({f"reward/{env}": float(reward[labels == env].mean()) for env in envs})
    return out
