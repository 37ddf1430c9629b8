"""The reference of the record under prime-rl 559b447's names, from the rollout log in plain
Python, written from prime-rl's `orchestrator/metrics.py` (`Stat`, `TraceMetrics`,
`EpisodeMetrics`, `TrainMetrics`) and the step's `metrics |= {...}` of `orchestrator.py`
at 559b447, with rlship's reading of them (docs/record.md): a logged rollout is one episode
of one trace of one branch, its agent its `agent` or verifiers' default `agent`, every
rollout completed (verifiers marks a finished trace so) and every group admitted (rlship
has no curriculum)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping

EPISODE_SUMS = ("num_total_tokens", "num_input_tokens", "num_output_tokens", "num_turns", "num_branches")
# rlship's own keys, kept under 559b447 as they are (they name nothing of prime-rl's).
OWN_PROGRESS = ("progress/total_input_tokens", "progress/total_output_tokens")
OWN_PROGRESS += ("progress/total_dropped_by_workers", "progress/total_steps", "progress/dropped_by_workers")


def stat(prefix: str, values: list[float]) -> dict[str, float]:
    """prime-rl's `Stat.to_dict`: its own percentile (rank q/100 x (n - 1), interpolated)."""
    if not values:
        return {}
    ordered = sorted(values)

    def percentile(q: float) -> float:
        rank = q / 100 * (len(ordered) - 1)
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

    return {
        f"{prefix}/mean": sum(values) / len(values),
        f"{prefix}/max": float(max(values)),
        f"{prefix}/min": float(min(values)),
        f"{prefix}/p10": percentile(10),
        f"{prefix}/p90": percentile(90),
    }


def quantity(line: dict, name: str) -> float:
    if name == "num_total_tokens":
        return float(line["num_input_tokens"] + line["num_output_tokens"])
    if name == "num_branches":
        return 1.0
    return float(line[name])


def agent_of(line: dict) -> str:
    return line.get("agent") or "agent"


def trace_metrics(lines: list[dict], prefix: str, subset: str) -> dict[str, float]:
    """`TraceMetrics.to_dict` and `TrainMetrics`' per-agent rates, for one agent."""
    out: dict[str, float] = {}
    for name in ("reward", *EPISODE_SUMS):
        out |= stat(f"{prefix}/{name}", [quantity(line, name) for line in lines])
    out[f"{prefix}/is_truncated/mean"] = sum(line["is_truncated"] for line in lines) / len(lines)
    out[f"{prefix}/is_completed/mean"] = 1.0
    for metric in sorted({m for line in lines for m in line["metrics"]}):
        out |= stat(
            f"{prefix}/metrics/{metric}",
            [line["metrics"][metric] for line in lines if metric in line["metrics"]],
        )
    if subset == "all":
        out[f"{prefix}/has_error/mean"] = sum(line["error"] is not None for line in lines) / len(lines)
        out[f"{prefix}/cancelled/mean"] = sum(line["cancelled"] for line in lines) / len(lines)
        for error, count in Counter(line["error"] for line in lines if line["error"] is not None).items():
            out[f"{prefix}/error/{error}"] = float(count)
        groups: dict[tuple[str, str], list[float]] = defaultdict(list)
        for line in lines:
            groups[(line["env"], line["group_id"])].append(line["reward"])
        none = sum(sum(rewards) == 0 for rewards in groups.values())
        every = sum(all(r == 1.0 for r in rewards) for rewards in groups.values())
        out[f"{prefix}/solved_none"] = none / len(groups)
        out[f"{prefix}/solved_all"] = every / len(groups)
        out[f"{prefix}/solved_some"] = 1 - (none + every) / len(groups)
    generation = [line["is_truncated"] and line["stop_condition"] != "prompt_too_long" for line in lines]
    out[f"{prefix}/stop_condition/generation_truncated"] = sum(generation) / len(lines)
    conditions = [line["stop_condition"] for line in lines if line["stop_condition"] is not None]
    for condition, count in Counter(conditions).items():
        out[f"{prefix}/stop_condition/{condition}"] = count / len(conditions)
    out[f"{prefix}/is_trainable/mean"] = sum(line["is_trainable"] for line in lines) / len(lines)
    out[f"{prefix}/is_admitted/mean"] = 1.0
    return out


def train_metrics(lines: list[dict], prefix: str, subset: str) -> dict[str, float]:
    """`TrainMetrics.to_wandb(prefix=..., subset=...)`: nothing for no episodes."""
    if not lines:
        return {}
    out: dict[str, float] = {}
    for name in EPISODE_SUMS:
        out |= stat(f"{prefix}/{subset}/{name}", [quantity(line, name) for line in lines])
    if subset == "all":
        out[f"{prefix}/{subset}/has_error/mean"] = sum(line["error"] is not None for line in lines) / len(
            lines
        )
        out[f"{prefix}/{subset}/cancelled/mean"] = sum(line["cancelled"] for line in lines) / len(lines)
    for agent in sorted({agent_of(line) for line in lines}):
        of_agent = [line for line in lines if agent_of(line) == agent]
        out |= trace_metrics(of_agent, f"{prefix}/{subset}/{agent}", subset)
    return out


def record_559b447(
    window: list[dict],
    shipped: list[dict],
    own: Mapping[str, float],
    window_totals_before: Mapping[str, float],
) -> dict[str, float]:
    """The step's 559b447 record: the metric matrix over window (`all`) and shipped
    (`effective`), its progress, off-policy and batch keys, and rlship's own keys of `own`
    (the reference's record under rlship's names) that keep their names."""
    out: dict[str, float] = {}
    for subset, lines in (("all", window), ("effective", shipped)):
        out |= train_metrics(lines, "train/agg", subset)
        for env in sorted({line["env"] for line in lines}):
            out |= train_metrics([line for line in lines if line["env"] == env], f"train/{env}", subset)
    out["progress/tokens"] = float(
        sum(line["num_input_tokens"] + line["num_output_tokens"] for line in window)
    )
    out["progress/input_tokens"] = float(sum(line["num_input_tokens"] for line in shipped))
    out["progress/output_tokens"] = float(sum(line["num_output_tokens"] for line in shipped))
    out["progress/rollouts"] = float(len(window))
    out["progress/tasks"] = float(len({(line["env"], line["group_id"]) for line in window}))
    for name in ("tokens", "rollouts", "tasks"):  # prime-rl logs its totals before adding the step
        out[f"progress/total_{name}"] = float(window_totals_before.get(name, 0.0))
    for env, count in Counter(line["env"] for line in window).items():
        out[f"batch/{env}"] = count / len(window)
    if "off_policy/staleness/mean" in own:
        out["off_policy/mean"] = own["off_policy/staleness/mean"]
        out["off_policy/max"] = own["off_policy/staleness/max"]
    out["off_policy/dropped"] = own["off_policy/stale_dropped"]
    for key, value in own.items():
        if key.startswith(("accounting/", "credit/", "step", *OWN_PROGRESS)):
            out[key] = value
    return out
