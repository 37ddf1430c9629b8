"""The reference: every record recomputed from the rollout log in plain Python.

No numpy, no Celery, no Redis: loops over the logged rollouts, written to be read. Which
rollouts a window or a step holds depends on timing (when a cut happened), so that comes
from the log; everything else is recomputed from the rollouts' own fields, including
the group advantages and the fates they imply. A record of the distributed path must
equal this one key for key, except the keys that measure time or the arrival stream,
which no log of finalized rollouts can reproduce (`UNREPRODUCIBLE`). The accounting
balance is recomputed too: the reference counts discarded, shipped, dropped and pending
rollouts itself and takes only arrived, rejected and in-open-groups from the record.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping

from tests.support.reference_559b447 import record_559b447

UNREPRODUCIBLE = (
    "time/",
    "event_loop_lag/",
    "accounting/arrived",
    "accounting/in_open_groups",
    "accounting/rejected",
    "ingest/rejected/",
    "empty_step/",
    "accounting/cancelled_groups",  # cancellations are stream entries, not finalized rollouts
)
# What the reference takes from the published record to check the balance: the log holds
# only finalized rollouts, so it cannot know what had arrived, been rejected or sat in an
# open group at a cut. Every other term of the balance it counts itself.
REPORTED_TERMS = ("accounting/arrived", "accounting/rejected", "accounting/in_open_groups")
WORKER_REASONS = ("invalid_payload", "no_trainable_tokens")
DISTRIBUTIONS = (
    "reward",
    "advantage",
    "num_total_tokens",
    "num_input_tokens",
    "num_output_tokens",
    "num_turns",
)
SOLVED_REWARD = 1.0
# prime-rl's names of record keys (tasks.stages.prime_names), written out again here.
PRIME_ALIASES = {
    "progress/samples": "progress/rollouts",
    "progress/problems": "progress/tasks",
    "progress/prefill_tokens": "progress/input_tokens",
    "progress/decode_tokens": "progress/output_tokens",
    "progress/total_samples": "progress/total_rollouts",
    "progress/total_problems": "progress/total_tasks",
    "scheduler/cancelled_rollouts": "off_policy/stale_dropped",
}
PRIME_PER_EXAMPLE = {
    "seq_len": "num_total_tokens",
    "prefill_len": "num_input_tokens",
    "decode_len": "num_output_tokens",
    "is_truncated": "is_truncated",
    "num_turns": "num_turns",
}


def reproducible(key: str) -> bool:
    return not key.startswith(UNREPRODUCIBLE)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
        "p10": percentile(values, 10),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
    }


def value(line: dict, name: str) -> float:
    if name == "num_total_tokens":
        return line["num_input_tokens"] + line["num_output_tokens"]
    return float(line[name])


def prime_rl_weights(
    mask: list[bool], advantages: list[float], rl_weights: list[float] | None
) -> list[float]:
    """A sample's rl weights as prime-rl 559b447 ships them (train_sink.py
    `_prune_zero_advantages`; its trainer reads an absent stream as 1.0 on the loss mask): a
    trainable token of zero advantage loses its weight, every other keeps its own."""
    weights = [1.0 if m else 0.0 for m in mask] if rl_weights is None else list(rl_weights)
    for index, (trainable, advantage, weight) in enumerate(zip(mask, advantages, weights, strict=True)):
        if trainable and advantage == 0.0 and weight != 0.0:
            weights[index] = 0.0
    return weights


def group_advantages(rewards: list[float]) -> list[float]:
    """Reward minus the group mean; exactly zero when all rewards are equal."""
    if all(r == rewards[0] for r in rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def check_advantages(lines: list[dict], tolerance: float = 1e-12) -> list[str]:
    """Recompute each group's advantages from its rewards; list every disagreement. A
    rollout whose producer gave its own credit (`credit` "given") takes no part in the
    baseline, and its logged advantage (its mean over its loss tokens) is not checked here."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for line in lines:
        groups[(line["env"], line["group_id"])].append(line)
    problems = []
    for key, members in groups.items():
        members = [m for m in members if m.get("credit") != "given"]
        scored = [m for m in members if m["error"] is None and not m["cancelled"]]
        expected = dict.fromkeys((m["rollout_id"] for m in members), 0.0)
        if scored:
            expected.update(
                zip(
                    (m["rollout_id"] for m in scored),
                    group_advantages([m["reward"] for m in scored]),
                    strict=True,
                )
            )
        for member in members:
            if not math.isclose(member["advantage"], expected[member["rollout_id"]], abs_tol=tolerance):
                problems.append(
                    f"group {key}: {member['rollout_id']} advantage {member['advantage']} "
                    f"!= {expected[member['rollout_id']]}"
                )
    return problems


def empty_subset(name: str) -> dict[str, float]:
    """No rollouts: count 0, and NaN for every statistic that has no observation."""
    out = {"count": 0.0}
    for metric in DISTRIBUTIONS:
        for stat in ("mean", "min", "max", "p10", "p50", "p90"):
            out[f"{metric}/{stat}"] = math.nan
    rates = ["is_truncated", "is_trainable"]
    if name == "all":
        rates += ["has_error", "cancelled"]
        out.update(
            {"num_groups": 0.0, "solved_none": math.nan, "solved_all": math.nan, "solved_some": math.nan}
        )
    for rate in rates:
        out[f"{rate}/mean"] = math.nan
    return out


def subset(lines: list[dict], name: str) -> dict[str, float]:
    if not lines:
        return empty_subset(name)
    out: dict[str, float] = {"count": float(len(lines))}
    custom = sorted({m for line in lines for m in line["metrics"]})
    for metric in DISTRIBUTIONS:
        for stat, x in stats([value(line, metric) for line in lines]).items():
            out[f"{metric}/{stat}"] = x
    for metric in custom:
        for stat, x in stats(
            [line["metrics"][metric] for line in lines if metric in line["metrics"]]
        ).items():
            out[f"metric/{metric}/{stat}"] = x
    out["is_truncated/mean"] = sum(line["is_truncated"] for line in lines) / len(lines)
    out["is_trainable/mean"] = sum(line["is_trainable"] for line in lines) / len(lines)
    if name == "all":
        out["has_error/mean"] = sum(line["error"] is not None for line in lines) / len(lines)
        out["cancelled/mean"] = sum(line["cancelled"] for line in lines) / len(lines)
        for error, count in Counter(line["error"] for line in lines if line["error"]).items():
            out[f"error/{error}"] = float(count)
        for condition, count in Counter(
            line["stop_condition"] for line in lines if line["stop_condition"]
        ).items():
            out[f"stop_condition/{condition}"] = count / len(lines)
        solved: dict[tuple[str, str], list[bool]] = defaultdict(list)
        for line in lines:
            solved[(line["env"], line["group_id"])].append(line["reward"] >= SOLVED_REWARD)
        out["num_groups"] = float(len(solved))
        out["solved_none"] = sum(not any(s) for s in solved.values()) / len(solved)
        out["solved_all"] = sum(all(s) for s in solved.values()) / len(solved)
        out["solved_some"] = 1.0 - out["solved_none"] - out["solved_all"]
    return out


def prime_rl_names(window: list[dict], record: Mapping[str, float]) -> dict[str, float]:
    """prime-rl's batch statistics over the step's `all` rollouts (its batch is every rollout
    generated for the step), per example (env and task) where prime-rl groups by example,
    and its names of the record's progress keys."""
    out = {name: record[source] for name, source in PRIME_ALIASES.items() if source in record}
    if not window:
        for name in PRIME_PER_EXAMPLE:
            out.update(dict.fromkeys((f"{name}/mean", f"{name}/max", f"{name}/min"), math.nan))
        out.update(dict.fromkeys((f"reward/{s}" for s in ("mean", "std", "min", "max", "median")), math.nan))
        solve = ("batch/solve_none", "batch/solve_all", "batch/effective_batch_size", "error/mean")
        solve += ("errored_rollouts/all",)
        return out | dict.fromkeys(solve, math.nan)
    examples: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for line in window:
        examples[(line["env"], line["task_id"])].append(line)
    for name, field in PRIME_PER_EXAMPLE.items():
        means = [sum(value(line, field) for line in lines) / len(lines) for lines in examples.values()]
        out[f"{name}/mean"] = sum(means) / len(means)
        out[f"{name}/max"] = max(means)
        out[f"{name}/min"] = min(means)
    rewards = [line["reward"] for line in window]
    out["reward/mean"] = sum(rewards) / len(rewards)
    out["reward/std"] = statistics.stdev(rewards) if len(rewards) > 1 else math.nan
    out["reward/min"], out["reward/max"] = min(rewards), max(rewards)
    out["reward/median"] = statistics.median(rewards)
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for line in window:
        groups[(line["env"], line["group_id"])].append(line["reward"])
    out["batch/solve_none"] = sum(sum(r) == 0 for r in groups.values()) / len(groups)
    out["batch/solve_all"] = sum(sum(r) == len(r) for r in groups.values()) / len(groups)
    out["batch/effective_batch_size"] = 1 - out["batch/solve_none"] - out["batch/solve_all"]
    errors = [line["error"] for line in window if line["error"]]
    out["error/mean"] = out["errored_rollouts/all"] = len(errors) / len(window)
    for env in {line["env"] for line in window}:
        of_env = [line for line in window if line["env"] == env]
        out[f"errored_rollouts/{env}"] = sum(line["error"] is not None for line in of_env) / len(of_env)
    for error, count in Counter(errors).items():
        out[f"error/{error}"] = count / len(errors)
    for metric in sorted({m for line in window for m in line["metrics"]}):
        observed = [line["metrics"][metric] for line in window if metric in line["metrics"]]
        out[f"metrics/{metric}"] = sum(observed) / len(observed)
    envs = {line["env"] for line in window}
    if len(envs) > 1:
        for env in envs:
            of_env = [line["reward"] for line in window if line["env"] == env]
            out[f"reward/{env}"] = sum(of_env) / len(of_env)
    return out


def is_worker_drop(line: dict) -> bool:
    return line["fate"] == "discarded" and line["reason"].startswith(WORKER_REASONS)


def drop_label(reason: str) -> str:
    """`invalid_payload: input_ids: length 11, ...` -> `input_ids`; other reasons as they are."""
    if reason.startswith("invalid_payload: "):
        return reason.removeprefix("invalid_payload: ").split(":")[0]
    return reason


def discarded_by_orchestrator_at(line: dict) -> int | None:
    """The step whose record counts the orchestrator's discard of this rollout, if any."""
    if line["fate"] != "discarded" or is_worker_drop(line):
        return None
    return line["discarded_step"]


def pending_at_cut(lines: list[dict], step: int) -> int:
    """Trainable rollouts finalized by the cut of `step` and neither cut nor dropped by then."""

    def settled(line: dict) -> bool:
        if line["fate"] == "shipped":
            return line["shipped_step"] <= step
        return (
            line["fate"] == "discarded"
            and line["discarded_step"] is not None
            and line["discarded_step"] <= step
        )

    return sum(
        line["is_trainable"] and line["step"] is not None and line["step"] <= step and not settled(line)
        for line in lines
    )


def balance(reported: Mapping[str, float], own: Mapping[str, float]) -> float:
    """1.0 when every rollout that arrived (as reported) is rejected or in an open group (as
    reported), or discarded, shipped, dropped by a worker or pending (as counted here)."""
    accounted = (
        reported["accounting/rejected"]
        + reported["accounting/in_open_groups"]
        + own["accounting/discarded"]
        + own["accounting/shipped"]
        + own["accounting/dropped_by_workers"]
        + own["accounting/pending"]
    )
    return float(reported["accounting/arrived"] == accounted)


def reference_records(
    lines: Iterable[dict], published: Iterable[Mapping[str, float]], *, first_step: int, names: str
) -> dict[int, dict[str, float]]:
    """The reproducible part of each published step's record, its balance checked with the
    terms the reference counts itself. Staleness is prime-rl's: its step s (this run's step
    less `first_step`, plus 1) trains a rollout of version v s - 1 - v steps off-policy.
    `names` is the run's `record_names`: `prime-rl-559b447` (tests.support.reference_559b447)
    or `rlship-1`."""
    lines = list(lines)
    reported = {int(record["step"]): record for record in published}
    totals: Counter[str] = Counter()
    window_totals: Counter[str] = Counter()  # the 559b447 record's totals, over the windows
    records = {}
    for step in sorted(reported):
        window = [line for line in lines if line["step"] == step]
        shipped = [line for line in lines if line["fate"] == "shipped" and line["shipped_step"] == step]
        dropped = [line for line in lines if is_worker_drop(line) and line["discarded_step"] == step]
        record: dict[str, float] = {"step": float(step)}
        envs = sorted({line["env"] for line in window + shipped})
        for name, members in (("all", window), ("effective", shipped)):
            for scope in ["agg", *envs]:
                part = members if scope == "agg" else [m for m in members if m["env"] == scope]
                for key, x in subset(part, name).items():
                    record[f"train/{scope}/{name}/{key}"] = x
        progress = {
            "input_tokens": float(sum(line["num_input_tokens"] for line in shipped)),
            "output_tokens": float(sum(line["num_output_tokens"] for line in shipped)),
            "rollouts": float(len(shipped)),
            "tasks": float(len({line["task_id"] for line in shipped})),
            "dropped_by_workers": float(len(dropped)),
        }
        progress["tokens"] = progress["input_tokens"] + progress["output_tokens"]
        totals.update(progress)
        totals["steps"] += 1
        for name, x in progress.items():
            record[f"progress/{name}"] = x
        for field, count in Counter(drop_label(line["reason"]) for line in dropped).items():
            record[f"progress/dropped_by_workers/{field}"] = float(count)
        for name, x in totals.items():
            record[f"progress/total_{name}"] = float(x)
        given = sum(line.get("credit") == "given" for line in shipped)
        record["credit/given"], record["credit/group_baseline"] = float(given), float(len(shipped) - given)
        if shipped:
            prime_rl_step = step - first_step + 1
            staleness = [prime_rl_step - 1 - line["policy_version"] for line in shipped]
            record["off_policy/staleness/mean"] = sum(staleness) / len(staleness)
            record["off_policy/staleness/max"] = float(max(staleness))
            for env, count in Counter(line["env"] for line in shipped).items():
                record[f"batch/{env}"] = count / len(shipped)
        counted = [line for line in lines if discarded_by_orchestrator_at(line) is not None]
        record["off_policy/stale_dropped"] = float(
            sum(line["reason"] == "stale" and line["discarded_step"] == step for line in counted)
        )
        discarded = Counter(line["reason"] for line in counted if line["discarded_step"] <= step)
        for reason, count in discarded.items():
            record[f"accounting/discarded/{reason}"] = float(count)
        record["accounting/discarded"] = float(sum(discarded.values()))
        record["accounting/shipped"] = float(totals["rollouts"])
        record["accounting/dropped_by_workers"] = float(totals["dropped_by_workers"])
        record["accounting/cut"] = float(totals["rollouts"] + totals["dropped_by_workers"])
        record["accounting/pending"] = float(pending_at_cut(lines, step))
        record.update(prime_rl_names(window, record))
        if names == "prime-rl-559b447":
            record = record_559b447(window, shipped, record, window_totals)
            window_totals.update(
                tokens=record["progress/tokens"],
                rollouts=record["progress/rollouts"],
                tasks=record["progress/tasks"],
            )
        record["accounting/balanced"] = balance(reported[step], record)
        records[step] = record
    return records


def compare(actual: dict[str, float], expected: dict[str, float], tolerance: float = 1e-12) -> list[str]:
    """Differences between a published record and the reference (reproducible keys only)."""
    mine = {k for k in actual if reproducible(k)}
    problems = [f"{k}: only in the published record" for k in sorted(mine - expected.keys())]
    problems += [f"{k}: missing from the published record" for k in sorted(expected.keys() - mine)]
    for key in sorted(mine & expected.keys()):
        if math.isnan(actual[key]) and math.isnan(expected[key]):
            continue
        if not math.isclose(actual[key], expected[key], rel_tol=tolerance, abs_tol=tolerance):
            problems.append(f"{key}: published {actual[key]!r}, reference {expected[key]!r}")
    return problems
