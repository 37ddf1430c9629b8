"""prime-rl 559b447's step statistics: what its orchestrator logs per step
(`orchestrator/metrics.py`'s `TrainMetrics.to_wandb` over the `{agg,<env>} x {all,effective}`
matrix, and the `progress/*`, `off_policy/*`, `batch/{env}` keys of `orchestrator.py`),
computed from rlship's cohorts for the record named `prime-rl-559b447`
(tasks.stages.record_names). docs/record.md maps each name to its rlship source.

prime-rl counts traces and episodes, rlship ships rollouts: `traces` folds a cohort's
rollouts into its traces (the branches of one verifiers trace, `episode_id` and `trace_id`,
into one, with the whole trace's counts its records carry) and `episode_sums` its traces
into episodes. A plain rollout is one episode of one trace of one branch. A trace's agent is
the record's `agent` (a verifiers trace's agent name), else verifiers' default name `agent`.
Distributions follow prime-rl's `Stat.to_dict`: mean, max, min, p10, p90 (linear
interpolation between closest ranks), nothing for an empty set; an empty subset or an env
absent from it has no keys at all, as prime-rl's `to_wandb` of no episodes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from tasks.cohort import CUSTOM_PREFIX, TRACE_PREFIX, Cohort

DEFAULT_AGENT = "agent"  # verifiers' AgentInfo.name when an env does not name its agent
STATS: tuple[str, ...] = ("mean", "max", "min", "p10", "p90")
EPISODE_SUMS: tuple[str, ...] = (
    "num_total_tokens",
    "num_input_tokens",
    "num_output_tokens",
    "num_turns",
    "num_branches",
)
TRACE_DISTRIBUTIONS: tuple[str, ...] = ("reward", *EPISODE_SUMS)
TRACE_COUNTS: tuple[str, ...] = ("num_input_tokens", "num_output_tokens", "num_total_tokens", "num_branches")
PROMPT_TOO_LONG = "prompt_too_long"  # the stop condition prime-rl does not count as generation-truncated
SOLVED_REWARD = 1.0


def distribution(prefix: str, values: np.ndarray) -> dict[str, float]:
    """prime-rl's `Stat.to_dict`: `{prefix}/{mean,max,min,p10,p90}`, empty when no values."""
    if not len(values):
        return {}
    p10, p90 = np.percentile(values, [10, 90])
    figures = (values.mean(), values.max(), values.min(), p10, p90)
    return {f"{prefix}/{stat}": float(value) for stat, value in zip(STATS, figures, strict=True)}


def _numbered(keys: Iterable[tuple[str, ...]]) -> np.ndarray:
    """Each key's number among the distinct keys, as first seen."""
    seen: dict[tuple[str, ...], int] = {}
    return np.array([seen.setdefault(key, len(seen)) for key in keys], dtype=np.int64)


def _any(flags: np.ndarray, key: np.ndarray, count: int) -> np.ndarray:
    """1.0 for each key with any row flagged."""
    out = np.zeros(count)
    np.maximum.at(out, key, flags)
    return out


def traces(cohort: Cohort) -> Cohort:
    """One row per trace: a verifiers trace's rollouts (its branches, by `episode_id` and
    `trace_id`) folded into their first, with the trace's own token and branch counts; a
    rollout of no trace is a trace of its own of one branch. A trace has an error, was
    cancelled, is trainable if any of its rollouts is."""
    labels = cohort.labels
    if any(labels["trace_id"]):
        rows = zip(labels["episode_id"], labels["trace_id"], labels["rollout_id"], strict=True)
        key = _numbered((episode, trace, "" if trace else rollout) for episode, trace, rollout in rows)
        folded = cohort.take(np.unique(key, return_index=True)[1])
    else:  # every rollout a trace of its own (a run's rollout ids are unique)
        key, folded = np.arange(len(cohort)), cohort
    own = {
        "num_input_tokens": folded.numeric["num_input_tokens"],
        "num_output_tokens": folded.numeric["num_output_tokens"],
        "num_total_tokens": folded.total_tokens(),
        "num_branches": np.ones(len(folded)),
    }
    columns = {}
    for name, value in own.items():
        given = folded.numeric.get(TRACE_PREFIX + name)
        columns[name] = value if given is None else np.where(np.isnan(given), value, given)
    for flag in ("has_error", "cancelled", "is_trainable"):
        columns[flag] = _any(cohort.numeric[flag], key, len(folded))
    return folded.with_numeric(**columns)


def episode_sums(trace_rows: Cohort) -> dict[str, np.ndarray]:
    """Per episode of `traces`' rows (`episode_id`; a rollout of none is an episode of its
    own): the sums of its traces' tokens, turns and branches, and whether any of its traces
    has an error or was cancelled (prime-rl's `EpisodeMetrics`)."""
    labels = trace_rows.labels
    rows = zip(labels["episode_id"], labels["rollout_id"], strict=True)
    if any(labels["episode_id"]):
        key = _numbered((episode, "" if episode else rollout) for episode, rollout in rows)
    else:  # every trace an episode of its own
        key = np.arange(len(trace_rows))
    count = int(key.max()) + 1 if len(key) else 0
    out = {name: np.bincount(key, weights=trace_rows.numeric[name], minlength=count) for name in EPISODE_SUMS}
    for flag in ("has_error", "cancelled"):
        out[flag] = _any(trace_rows.numeric[flag], key, count)
    return out


def _agents(cohort: Cohort) -> list[str]:
    return [agent or DEFAULT_AGENT for agent in cohort.labels["agent"]]


def _solve_rates(cohort: Cohort) -> dict[str, float]:
    """Groups none of whose rewards is above 0 (they sum to 0), all of whose rewards are
    1.0, and the rest, as shares of the groups."""
    groups = cohort.rewards_by_group()
    none = sum(sum(rewards) == 0 for rewards in groups)
    every = sum(all(r == SOLVED_REWARD for r in rewards) for rewards in groups)
    return {
        "solved_none": none / len(groups),
        "solved_all": every / len(groups),
        "solved_some": 1 - (none + every) / len(groups),
    }


def _stop_conditions(cohort: Cohort) -> dict[str, float]:
    """`generation_truncated` (truncated, not for a too long prompt) over every trace; each
    stop condition's share among the traces that have one."""
    conditions = cohort.labels["stop_condition"]
    truncated = cohort.numeric["is_truncated"].astype(bool)
    generation = sum(bool(t) and c != PROMPT_TOO_LONG for t, c in zip(truncated, conditions, strict=True))
    out = {"generation_truncated": generation / len(cohort)}
    given = [c for c in conditions if c]
    out.update({c: n / len(given) for c, n in sorted(Counter(given).items())})
    return out


def agent_metrics(cohort: Cohort, prefix: str, subset: str) -> dict[str, float]:
    """One agent's statistics over its traces (`traces`' rows): prime-rl's
    `TraceMetrics.to_dict` and `TrainMetrics`' rates."""
    out: dict[str, float] = {}
    for name in TRACE_DISTRIBUTIONS:
        out |= distribution(f"{prefix}/{name}", cohort.numeric[name])
    out[f"{prefix}/is_truncated/mean"] = float(cohort.numeric["is_truncated"].mean())
    out[f"{prefix}/is_completed/mean"] = 1.0  # every finalized rollout finished its run
    for name in cohort.custom_metric_names:
        values = cohort.numeric[CUSTOM_PREFIX + name]
        out |= distribution(f"{prefix}/metrics/{name}", values[~np.isnan(values)])
    if subset == "all":
        out[f"{prefix}/has_error/mean"] = float(cohort.numeric["has_error"].mean())
        out[f"{prefix}/cancelled/mean"] = float(cohort.numeric["cancelled"].mean())
        for error, count in sorted(Counter(e for e in cohort.labels["error"] if e).items()):
            out[f"{prefix}/error/{error}"] = float(count)
        out |= {f"{prefix}/{key}": value for key, value in _solve_rates(cohort).items()}
    out |= {f"{prefix}/stop_condition/{key}": value for key, value in _stop_conditions(cohort).items()}
    out[f"{prefix}/is_trainable/mean"] = float(cohort.numeric["is_trainable"].mean())
    out[f"{prefix}/is_admitted/mean"] = 1.0  # rlship has no curriculum: every group is admitted
    return out


def subset_metrics(cohort: Cohort, prefix: str, subset: str) -> dict[str, float]:
    """`{prefix}/...` of one scope and subset over its traces (`traces`' rows): prime-rl's
    `TrainMetrics.to_wandb`, its episode keys over `episode_sums`."""
    if not len(cohort):
        return {}
    out: dict[str, float] = {}
    episodes = episode_sums(cohort)
    for name in EPISODE_SUMS:
        out |= distribution(f"{prefix}/{name}", episodes[name])
    if subset == "all":
        out[f"{prefix}/has_error/mean"] = float(episodes["has_error"].mean())
        out[f"{prefix}/cancelled/mean"] = float(episodes["cancelled"].mean())
    agents = np.asarray(_agents(cohort))
    for agent in sorted(set(agents.tolist())):
        out |= agent_metrics(cohort.take(agents == agent), f"{prefix}/{agent}", subset)
    return out


def train_metrics(window: Cohort, shipped: Cohort) -> dict[str, float]:
    """`train/{agg,<env>}/{all,effective}/...` over `traces`' rows: `all` is the window's
    (every rollout finalized since the previous cut), `effective` the shipped rollouts'; an
    env per subset where it has rollouts."""
    out: dict[str, float] = {}
    for subset, cohort in (("all", window), ("effective", shipped)):
        out |= subset_metrics(cohort, f"train/agg/{subset}", subset)
        for env in sorted(set(cohort.labels["env"])):
            out |= subset_metrics(cohort.where("env", env), f"train/{env}/{subset}", subset)
    return out


def step_counts(window: Cohort) -> dict[str, float]:
    """This step's `progress/*` that 559b447 counts over the window's traces (`traces`' rows:
    tokens, traces, tasks; its input and output tokens are the shipped rollouts', rlship's
    own keys) and `batch/{env}` (each env's share of the window's traces)."""
    out = {
        "progress/tokens": float(window.numeric["num_total_tokens"].sum()),
        "progress/rollouts": float(len(window)),
        "progress/tasks": float(len(set(zip(window.labels["env"], window.labels["group_id"], strict=True)))),
    }
    for env, count in sorted(Counter(window.labels["env"]).items()):
        out[f"batch/{env}"] = count / len(window)
    return out


def event_loop_lag(loop_lag_ms: np.ndarray) -> dict[str, float]:
    """prime-rl's lag statistics in seconds (its pipeline logger's names), over the probe's
    samples since the previous cut; none without a sample."""
    if not len(loop_lag_ms):
        return {}
    lag = np.asarray(loop_lag_ms, dtype=np.float64) / 1000.0
    p50, p90, p99 = np.percentile(lag, [50, 90, 99])
    figures = {"min": lag.min(), "mean": lag.mean(), "median": p50, "p90": p90, "p99": p99, "max": lag.max()}
    return {f"event_loop_lag/{name}": float(value) for name, value in figures.items()} | {
        "event_loop_lag/n": float(len(lag))
    }


def from_step(window: Cohort, shipped: Cohort, loop_lag_ms: np.ndarray) -> dict[str, float]:
    """Everything of the 559b447 record the metrics stage computes from the cohorts."""
    window = traces(window)
    return train_metrics(window, traces(shipped)) | step_counts(window) | event_loop_lag(loop_lag_ms)
