"""prime-rl 559b447's step metrics over verifiers episodes, in plain Python, written from its
`orchestrator/metrics.py` (`TraceMetrics`, `EpisodeMetrics`, `TrainMetrics`,
`TrainEpisodes.effective`) and the `progress/*`, `batch/{env}` of `orchestrator.py`'s step:
the oracle of the record's per-trace and per-episode keys, independent of rlship's code.

A selection is a list of (episode, trace) pairs, prime-rl's `TraceRecord`s: `all` every trace
of the window's episodes, `effective` the traces sampled into the batch that have no error,
of an agent that trains (every group admitted, none cancelled). Episode sums are over the
selected traces of each selected episode, as `EpisodeMetrics._episode_stat` sums its records.
Left out, as rlship does not have them (docs/record.md): a trace's `timing/*` and
`rewards/{name}`."""

from __future__ import annotations

from collections import Counter

import verifiers.v1 as vf

from tests.support.reference_559b447 import stat

Selection = list[tuple[vf.Episode, vf.Trace]]
SUMS = ("num_total_tokens", "num_input_tokens", "num_output_tokens", "num_turns", "num_branches")


def is_trainable(trace: vf.Trace) -> bool:
    """`algo/routing.py`'s `is_trainable`: a non-zero advantage on a node."""
    return any(value != 0.0 for node in trace.nodes for value in node.advantages or [])


def _trace_keys(traces: list[tuple[vf.Episode, vf.Trace]], prefix: str, subset: str) -> dict[str, float]:
    """`TraceMetrics.to_dict` (without timing and rewards) and `TrainMetrics`' rates."""
    only = [trace for _, trace in traces]
    out: dict[str, float] = {}
    for name in ("reward", *SUMS):
        out |= stat(f"{prefix}/{name}", [float(getattr(trace, name)) for trace in only])
    for name in ("is_truncated", "is_completed"):
        out[f"{prefix}/{name}/mean"] = sum(float(getattr(trace, name)) for trace in only) / len(only)
    for name in sorted({name for trace in only for name in trace.metrics}):
        values = [trace.metrics[name] for trace in only if name in trace.metrics]
        out |= stat(f"{prefix}/metrics/{name}", [0.0 if v is None else float(v) for v in values])
    if subset == "all":
        out[f"{prefix}/has_error/mean"] = sum(float(trace.has_error) for trace in only) / len(only)
        out[f"{prefix}/cancelled/mean"] = 0.0
        types = [t.last_error.type for t in only if t.has_error and t.last_error is not None]
        out |= {f"{prefix}/error/{kind}": float(count) for kind, count in sorted(Counter(types).items())}
        groups: dict[str, list[float]] = {}
        for episode, trace in traces:
            groups.setdefault(episode.group.id, []).append(trace.reward)
        none = sum(sum(rewards) == 0 for rewards in groups.values())
        every = sum(all(r == 1.0 for r in rewards) for rewards in groups.values())
        out[f"{prefix}/solved_none"] = none / len(groups)
        out[f"{prefix}/solved_all"] = every / len(groups)
        out[f"{prefix}/solved_some"] = 1 - (none + every) / len(groups)
    generation = sum(t.is_truncated and t.stop_condition != "prompt_too_long" for t in only)
    out[f"{prefix}/stop_condition/generation_truncated"] = generation / len(only)
    conditions = [t.stop_condition for t in only if t.stop_condition is not None]
    for condition in sorted(set(conditions)):
        out[f"{prefix}/stop_condition/{condition}"] = conditions.count(condition) / len(conditions)
    out[f"{prefix}/is_trainable/mean"] = sum(float(is_trainable(t)) for t in only) / len(only)
    out[f"{prefix}/is_admitted/mean"] = 1.0
    return out


def train_to_wandb(selection: Selection, prefix: str, subset: str) -> dict[str, float]:
    """`TrainMetrics.to_wandb(prefix=prefix, subset=subset)` of a selection."""
    if not selection:
        return {}
    episodes: dict[str, vf.Episode] = {}
    sums: dict[str, dict[str, float]] = {}
    for episode, trace in selection:
        episodes.setdefault(episode.id, episode)
        mine = sums.setdefault(episode.id, dict.fromkeys(SUMS, 0.0))
        for name in SUMS:
            mine[name] += float(getattr(trace, name))
    out: dict[str, float] = {}
    for name in SUMS:
        out |= stat(f"{prefix}/{subset}/{name}", [mine[name] for mine in sums.values()])
    if subset == "all":
        errored = [not e.ok or any(t.has_error for t in e.traces) for e in episodes.values()]
        out[f"{prefix}/{subset}/has_error/mean"] = sum(map(float, errored)) / len(errored)
        out[f"{prefix}/{subset}/cancelled/mean"] = 0.0
    for agent in sorted({trace.agent.name for _, trace in selection}):
        mine = [(e, t) for e, t in selection if t.agent.name == agent]
        out |= _trace_keys(mine, f"{prefix}/{subset}/{agent}", subset)
    return out


def step_metrics(window: Selection, effective: Selection) -> dict[str, float]:
    """The step's `train/{agg,<env>}/{all,effective}/...`, and the window's `progress/tokens`,
    `progress/rollouts` (traces), `progress/tasks` (groups) and `batch/{env}` (traces' shares)."""
    out: dict[str, float] = {}
    for subset, selection in (("all", window), ("effective", effective)):
        out |= train_to_wandb(selection, "train/agg", subset)
        for env in sorted({episode.env.name for episode, _ in selection}):
            mine = [(e, t) for e, t in selection if e.env.name == env]
            out |= train_to_wandb(mine, f"train/{env}", subset)
    out["progress/tokens"] = float(sum(trace.num_total_tokens for _, trace in window))
    out["progress/rollouts"] = float(len(window))
    out["progress/tasks"] = float(len({episode.group.id for episode, _ in window}))
    envs = Counter(episode.env.name for episode, _ in window)
    return out | {f"batch/{env}": count / len(window) for env, count in sorted(envs.items())}
