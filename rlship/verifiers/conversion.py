"""Episodes to rollouts: a verifiers v1 `Episode` (verifiers 0.4.0) turned into rlship
rollouts, `(RolloutRecord, arrays)`, one per trainable branch, with the meaning prime-rl
559b447's train sink gives them (`orchestrator/trajectories.py`, `algo/base.py`,
`algo/routing.py`, `algo/grpo.py`, `train_sink.py`).

What is kept of each trace and branch:
- a trace trains nothing if it errored, if its agent is not trainable, or if no branch of it
  has a sampled token left to train: it becomes one record of no tokens (`untrained`: the
  error's type as its `error`, else credit of no token), so the step's `all` statistics count
  it as prime-rl 559b447's count every trace of the window (`has_error`, `error/{type}`,
  `is_trainable` per agent) while it ships nothing;
- a branch becomes one rollout; a sampled node shared by several branches (a fork) trains in
  the first branch holding it only (the later ones carry it as context); a branch left with
  nothing to train is skipped;
- per token: the node logprobs and reference logprobs spread onto their sampled positions,
  the `rl`/`ce`/`ref_kl` loss-weight streams (a shared node weighted once per stream), the
  advantages (the episode's own, else `grpo_advantages` of its group), routed experts and
  modality markers (made by rlship.verifiers.layout, a group's nodes converted together, each once).

Where verifiers 0.4.0 differs from the verifiers prime-rl 559b447 pinned, this follows the
meaning (docs/integrators.md, "From prime-rl's environment servers"): 0.4.0's `Branch` has no
`multi_modal_data`; a branch carries images when the trace's `mm_token_type_id_map` marks any
of its tokens, and then gets `mm_token_type_ids` (no pixel tensors travel in 0.4.0 episodes).
A branch 0.4.0 marks not trainable (an abandoned compaction attempt) is skipped. Sampling
masks are not carried (prime-rl 559b447's samples have none either).

Bad input is named, never guessed around: a mask, logprobs, advantages, loss weights or
routed experts not aligned with a node's token ids, a loss stream of another name, a trace
with no token ids (an eval client's), an episode of another run: one line each, keyed
`episode/trace/branch`, raised together as `RolloutRejected`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import verifiers.v1 as vf

from orchestrator.records import IDENTIFIER, InvalidRecord, RolloutRecord
from orchestrator.rollout_checks import RolloutRejected
from rlship.verifiers.layout import LOSS_STREAMS, ActionLoss, GroupLayout
from rlship.verifiers.trace_counts import trace_counts

Rollout = tuple[RolloutRecord, dict[str, Any]]
Made = tuple[dict[str, Any], dict[str, Any], vf.Episode, vf.Trace]  # a rollout's fields, arrays, whose
_NOT_IDENTIFIER = re.compile(r"[^A-Za-z0-9_.\-/]")


@dataclass
class GroupRollouts:
    """What one group of episodes became: its rollouts, a record of no tokens for each trace
    that trains nothing, and how many of those traces by why."""

    rollouts: list[Rollout] = field(default_factory=list)
    untrained: list[Rollout] = field(default_factory=list)  # one record of no tokens a trace
    errored_traces: int = 0  # prime-rl's count: errored traces, plus episodes failed with none
    not_trainable_traces: int = 0  # traces of an agent that does not train
    untrained_traces: int = 0  # clean traces with no branch left to train

    @property
    def written(self) -> list[Rollout]:
        """Every rollout the group is written as: its rollouts, then its records of no tokens."""
        return [*self.rollouts, *self.untrained]


@lru_cache(maxsize=1 << 14)
def identifier(value: str) -> str:
    """`value` as a record identifier: characters it may not hold replaced by `-`."""
    text = _NOT_IDENTIFIER.sub("-", value)[:200]
    return text if IDENTIFIER.fullmatch(text) else "-"


def trainable_traces(episodes: Iterable[vf.Episode]) -> list[tuple[vf.Episode, vf.Trace]]:
    """The clean traces of trainable agents with a sampled token, in episode order."""
    return [
        (episode, trace)
        for episode in episodes
        for trace in episode.traces
        if not trace.has_error and trace.agent.trainable and any(True in node.mask for node in trace.nodes)
    ]


def grpo_advantages(episodes: Sequence[vf.Episode]) -> dict[str, float]:
    """prime-rl's plain GRPO over a group: each trainable trace's reward minus the mean of
    theirs, by trace id (what `GRPOAlgorithm.score_group` assigns, without length shaping)."""
    return _grpo([trace for _, trace in trainable_traces(episodes)])


def _grpo(traces: Sequence[vf.Trace]) -> dict[str, float]:
    """`grpo_advantages` over a group's trainable traces, in episode order."""
    if not traces:
        return {}
    rewards = np.array([trace.reward for trace in traces], dtype=np.float32)
    advantages = rewards - rewards.mean(dtype=np.float32)
    return {trace.id: float(value) for trace, value in zip(traces, advantages.tolist(), strict=True)}


def has_advantages(episodes: Sequence[vf.Episode]) -> bool:
    """Whether the user's algorithm assigned credit to any trainable trace of the group (the
    nodes are looked at for credit first: most groups have none)."""
    if all(
        node.advantages is None for episode in episodes for trace in episode.traces for node in trace.nodes
    ):
        return False
    return any(
        not trace.has_error
        and trace.agent.trainable
        and any(node.advantages is not None for node in trace.nodes)
        and any(True in node.mask for node in trace.nodes)
        for episode in episodes
        for trace in episode.traces
    )


@dataclass(frozen=True)
class Conversion:
    """How a group's episodes become rollouts: the run they must be of (None: any), the
    version stamped on an episode without a policy span, the env's sampling temperature,
    the algorithm's action loss (prime-rl's `action_loss_type`), the token-type map
    (None: each trace's own), and whether the episodes are one whole group written together
    (then every record says how many the group has: `group_rollouts`)."""

    run_id: str | None = None
    policy_version: int | None = None
    temperature: float = 1.0
    action_loss: ActionLoss = "rl"
    mm_token_type_ids_mapping: Mapping[int, int] | None = None
    whole_group: bool = False


def episode_rollouts(
    episode: vf.Episode | bytes,
    *,
    run_id: str | None = None,
    policy_version: int | None = None,
    temperature: float = 1.0,
    action_loss: ActionLoss = "rl",
    mm_token_type_ids_mapping: Mapping[int, int] | None = None,
    trace_advantages: Mapping[str, float] | None = None,
) -> list[Rollout]:
    """One episode's rollouts, one per trainable branch (module docstring), or
    `RolloutRejected` naming each bad episode, trace and branch. `episode` may be the
    msgpack bytes an environment server's episode packs to (`decode_episode`). Per-token
    advantages are the episode's own where it carries them, else `trace_advantages[trace.id]`
    broadcast over the trace's sampled tokens (as prime-rl's `assign_advantages`), else none."""
    conversion = Conversion(run_id, policy_version, temperature, action_loss, mm_token_type_ids_mapping)
    return convert_group([decode_episode(episode)], conversion, trace_advantages).rollouts


def decode_episode(episode: vf.Episode | bytes) -> vf.Episode:
    """An episode, or the msgpack bytes of one as verifiers' serve encoding packs it
    (`verifiers.v1.serve.delta.pack(dump(episode))`), validated as verifiers' client does."""
    if not isinstance(episode, bytes | bytearray | memoryview):
        return episode
    from verifiers.v1.episode import WireEpisode
    from verifiers.v1.serve.delta import unpack

    return WireEpisode.model_validate(unpack(bytes(episode)))


def encode_episode(episode: vf.Episode) -> bytes:
    """An episode as msgpack bytes, with verifiers' serve encoding (`decode_episode` reads it)."""
    from verifiers.v1.serve.delta import dump, pack

    return pack(dump(episode))


def convert_group(
    episodes: Sequence[vf.Episode],
    conversion: Conversion,
    trace_advantages: Mapping[str, float] | None = None,
    *,
    grpo: bool = False,
) -> GroupRollouts:
    """Every rollout of a group's episodes and what was left out; `RolloutRejected` if any
    episode, trace or branch is bad (all of them named). With `grpo`, the group's credit is
    prime-rl's plain GRPO over it (`grpo_advantages`, found here with the group's layout)
    unless a trace carries its algorithm's own (`trace_advantages` is then not taken)."""
    if grpo and trace_advantages is not None:
        raise ValueError("convert_group: trace_advantages or grpo, not both")
    result = GroupRollouts()
    problems: dict[str, str] = {}
    given = has_advantages(episodes)
    refused = [_episode_problem(episode, conversion) for episode in episodes]
    candidates = [
        trace
        for episode, problem in zip(episodes, refused, strict=True)
        if problem is None
        for trace in episode.traces
        if not trace.has_error and trace.agent.trainable
    ]
    layout = GroupLayout(candidates)
    aligned = layout.aligned()
    # every trace of the episodes taken, in order: its episode's record fields, its place in `trains`
    plan: list[tuple[vf.Episode, vf.Trace, dict[str, Any], int | None]] = []
    trains: list[vf.Trace] = []
    for episode, problem in zip(episodes, refused, strict=True):
        if problem is not None:
            problems[episode.id] = f"episode {episode.id!r}: {problem}"
            continue
        shared = _episode_fields(episode, conversion)
        result.errored_traces += sum(trace.has_error for trace in episode.traces)
        result.errored_traces += int(not episode.traces and not episode.ok)
        for trace in episode.traces:
            if trace.has_error or not trace.agent.trainable:
                result.not_trainable_traces += int(not trace.has_error)
                plan.append((episode, trace, shared, None))
                continue
            where = f"{episode.id}/{trace.id}"
            found = {} if aligned else _trace_problems(trace, conversion, where)
            if (
                given
                and conversion.action_loss == "rl"
                and not found
                and all(node.advantages is None for node in trace.nodes)
            ):
                found = {
                    where: f"trace {where}: advantages: none on any node, while other traces of the "
                    "group carry the algorithm's (an rl token without credit: prime-rl's trainer refuses it)"
                }
            if found:
                problems |= found
                continue
            plan.append((episode, trace, shared, len(trains)))
            trains.append(trace)
    if len(trains) < len(candidates):  # bad traces left out: the rest laid out again
        layout = GroupLayout(trains)
    if grpo and not given:
        trace_advantages = _grpo(
            [trace for place, trace in enumerate(trains) if layout.traces_sampled[place]]
        )
    layout.fill([(trace_advantages or {}).get(trace.id) for trace in trains])
    trained: list[Made] = []  # record fields and arrays, and whose they are
    untrained: list[Made] = []
    for episode, trace, shared, place in plan:
        rollouts = [] if place is None else _trace_rollouts(episode, trace, shared, place, layout, conversion)
        if place is not None and not rollouts:
            result.untrained_traces += 1
        if not rollouts:
            untrained.append((*_untrained_rollout(episode, trace, shared), episode, trace))
        trained.extend((fields, arrays, episode, trace) for fields, arrays in rollouts)
    size = (
        {"group_rollouts": len(trained) + len(untrained)}
        if conversion.whole_group and trained + untrained
        else {}
    )
    result.rollouts = _records(trained, size, problems)
    result.untrained = _records(untrained, size, problems)
    if problems:
        raise RolloutRejected(problems)
    return result


def _records(made: list[Made], size: dict[str, int], problems: dict[str, str]) -> list[Rollout]:
    """The rollouts' records built from their fields (and the group's size, if given); a bad
    one named in `problems` under its id."""
    rollouts = []
    for record_fields, arrays, episode, trace in made:
        try:
            rollouts.append((RolloutRecord(**record_fields, **size), arrays))
        except InvalidRecord as exc:
            problems[record_fields["rollout_id"]] = f"episode {episode.id!r}, trace {trace.id!r}: {exc}"
    return rollouts


def _episode_problem(episode: vf.Episode, conversion: Conversion) -> str | None:
    """Why an episode cannot train in this run at all, or None."""
    if episode.env.name is None:
        return "env.name: missing (the name the run knows the environment by)"
    if episode.group is None:
        return "group: missing (a training episode belongs to a rollout group)"
    run = episode.run
    if run is not None and conversion.run_id is not None and run.id != conversion.run_id:
        return f"run.id: {run.id!r} is another run's (this is run {conversion.run_id!r})"
    if run is not None and (
        not isinstance(run, vf.TrainRunInfo) or not isinstance(run.work, vf.TrainWorkInfo)
    ):
        work = getattr(getattr(run, "work", None), "type", "eval")
        return f"run: {run.type} run's {work} work, not training work"
    if _policy_version(episode, conversion) is None:
        return "run.work.policy: no policy span, and no policy_version given for it"
    return None


def _policy_version(episode: vf.Episode, conversion: Conversion) -> int | None:
    """The policy version that sampled the episode: its policy span's start (prime-rl's
    staleness reads the start), else the version given."""
    run = episode.run
    if isinstance(run, vf.TrainRunInfo) and isinstance(run.work, vf.TrainWorkInfo) and run.work.policy:
        return run.work.policy.start
    return conversion.policy_version


def _trace_problems(trace: vf.Trace, conversion: Conversion, where: str) -> dict[str, str]:
    """Why a clean trace of a trainable agent cannot train: node by node, named."""
    if trace.nodes and not any(node.token_ids for node in trace.nodes):
        return {where: f"trace {where}: no token ids on any node (an eval client's trace?)"}
    problems = []
    for index, node in enumerate(trace.nodes):
        tokens = len(node.token_ids)
        sampled = node.mask.count(True)
        if len(node.mask) != tokens:
            problems.append(f"node {index}: mask of {len(node.mask)} for {tokens} token ids")
            continue
        for name in ("logprobs", "advantages", "reference_logprobs"):
            values = getattr(node, name)  # over the sampled tokens (a node with none ignores them)
            if values is not None and sampled and len(values) != sampled:
                problems.append(f"node {index}: {name} of {len(values)} for {sampled} sampled tokens")
        for stream, weights in (node.loss_weights or {}).items():
            if stream not in LOSS_STREAMS:
                problems.append(f"node {index}: loss stream {stream!r} is not one of {list(LOSS_STREAMS)}")
            elif len(weights) != tokens:
                problems.append(
                    f"node {index}: loss stream {stream!r} of {len(weights)} for {tokens} token ids"
                )
        experts = node.routed_experts
        if experts is not None and (experts.ndim != 3 or len(experts) != tokens):
            problems.append(
                f"node {index}: routed_experts of shape {list(experts.shape)} for {tokens} token ids "
                "(expected [tokens, layers, topk])"
            )
    if not problems:
        return {}
    return {where: f"trace {where}: " + "; ".join(problems)}


def _trace_rollouts(
    episode: vf.Episode,
    trace: vf.Trace,
    shared: dict[str, Any],
    place: int,
    layout: GroupLayout,
    conversion: Conversion,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """A checked trace's rollouts (at `place` in the group's layout; `shared`: its episode's
    record fields): record fields and arrays, one per trainable branch."""
    made = layout.rollouts(place, conversion.action_loss, conversion.mm_token_type_ids_mapping)
    if not made:
        return []
    fields = _trace_fields(shared, trace)
    return [
        (
            fields
            | {
                "rollout_id": identifier(f"{episode.id}/{trace.id}/{index}"),
                "num_input_tokens": len(arrays["loss_mask"]) - output_tokens,
                "num_output_tokens": output_tokens,
            },
            arrays,
        )
        for index, arrays, output_tokens in made
    ]


def _untrained_rollout(
    episode: vf.Episode, trace: vf.Trace, shared: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trace that trains nothing as one record of no tokens: its error's type as the
    record's `error` (an error verifiers gave no type: `error`), and credit of no token, so
    it takes no part in its group's baseline and its fate is not trainable."""
    record = _trace_fields(shared, trace) | {
        "rollout_id": identifier(f"{episode.id}/{trace.id}"),
        "num_input_tokens": 0,
        "num_output_tokens": 0,
    }
    if trace.has_error:
        error = trace.last_error
        record["error"] = identifier(error.type if error is not None else "error")
    arrays = {
        "input_ids": np.zeros(0, dtype=np.int64),
        "loss_mask": np.zeros(0, dtype=bool),
        "inference_logprobs": np.zeros(0, dtype=np.float32),
        "advantages": np.zeros(0, dtype=np.float32),
    }
    return record, arrays


def _episode_fields(episode: vf.Episode, conversion: Conversion) -> dict[str, Any]:
    """The record fields every rollout of an episode shares (its id: the record counts
    traces and episodes as prime-rl does)."""
    return {
        "group_id": identifier(episode.group.id),  # type: ignore[union-attr]  # checked
        "env": identifier(episode.env.name or ""),
        "policy_version": _policy_version(episode, conversion),
        "temperature": conversion.temperature,
        "episode_id": identifier(episode.id),
    }


def _trace_fields(shared: dict[str, Any], trace: vf.Trace) -> dict[str, Any]:
    """The record fields every rollout of a trace shares: its episode's (`shared`), and its own."""
    return shared | {
        "task_id": identifier(_task_key(trace)),
        "reward": trace.reward,
        "num_turns": trace.num_turns,
        "is_truncated": trace.is_truncated,
        "stop_condition": identifier(trace.stop_condition) if trace.stop_condition else None,
        "metrics": {identifier(k): float(v) for k, v in trace.metrics.items() if v is not None},
        "agent": identifier(trace.agent.name),
        "trace": trace_counts(trace, identifier(trace.id)),  # the whole trace's counts
    }


def _task_key(trace: vf.Trace) -> str:
    """The task's stable identity: its key, else its content hash, else its row index."""
    task = trace.task
    if task.key or task.hash:
        return str(task.key or task.hash)
    index = getattr(task.data, "idx", None)
    return f"{task.type}-{index}" if index is not None else task.type
