"""The samples prime-rl's orchestrator at commit 559b447 makes of verifiers v1 episodes:
the test oracle of rlship.verifiers, written from prime-rl's public source and not from
rlship's code (nothing here imports rlship's packages).

What it models (prime-rl 559b44772, "chore: bump verifiers to latest main (#3337)"):
- `algo/base.py` `iter_trainable_traces`: per episode, per trace, skip a trace with an
  error (`trace.has_error`), of an agent not trainable, or with no node whose mask has a
  True;
- `algo/grpo.py` `GRPOAlgorithm.score_group` without length penalty: float32 rewards of
  those traces minus their mean; `algo/routing.py` `assign_advantages(trace, scalar)`:
  every node with a True in its mask gets `[scalar] * sum(mask)` as `node.advantages`;
- `trajectories.py` `iter_trainable_branches`: over `trace.branches`, the mask is the
  concatenated node masks, except a sampled node with a True in its mask that an earlier
  branch already trained contributes all False; a branch whose mask has no True is skipped;
  `_loss_weights(branch, name, trained)`: per node its `loss_weights[name]` (zeros if absent
  or the node already in `trained`), the node added to `trained` when any weight is
  non-zero; the stream is None unless some weight is non-zero; `trace_to_samples`: one
  sample per branch with `branch.token_ids`, the mask, `branch.logprobs`,
  `branch.reference_logprobs`, the routed experts (`branch.routed_experts`, padded or cut to
  the token count), the three streams (rl, then ce, then ref_kl, trained sets per trace) and
  `branch.advantages`;
- `train_sink.py` `process_group`: `temperatures = [env temperature] * len(token_ids)`, then
  `algo/routing.py` `stamp_loss_routing` (`rl`: nothing; `ce`/`ref_kl`: rl weights all 0,
  the action stream 1.0 on the mask, `ce` starting from the sample's own ce weights);
  `process_batch` with `filter_zero_advantages` (its default, True): `_prune_zero_advantages`;
- `transports/rollouts/types.py` `MicroBatch` (16 positional fields, `array_like`): what a
  559b447 trainer rank decodes from a step's message or file (`decode_micro_batches`).

Two adaptations to verifiers 0.4.0 (the version prime-rl 559b447 pinned, a60a606, differs):
0.4.0's `Branch` has no `multi_modal_data`; the branch counts as carrying images when
0.4.0's own `Branch.mm_token_type_ids` is not None, and its `mm_token_type_ids` are then the
mapping applied to every token (no `mm_kwargs`: 0.4.0 episodes carry no pixels). And 0.4.0
added `Branch.trainable` (False for an abandoned compaction attempt): such a branch yields
no sample.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import verifiers.v1 as vf


@dataclass
class PrimeSample:
    """prime-rl's `TrainingSample` fields (transports/rollouts/types.py), as plain values."""

    token_ids: list[int]
    mask: list[bool]
    logprobs: list[float]
    temperatures: list[float]
    env_name: str
    ref_logprobs: list[float] | None = None
    mm_token_type_ids: list[int] | None = None
    routed_experts: np.ndarray | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    advantages: list[float] | None = None


def trainable_traces(episodes: Sequence[vf.Episode]) -> list[vf.Trace]:
    out = []
    for episode in episodes:
        for trace in episode.traces:
            if trace.has_error or not trace.agent.trainable:
                continue
            if any(any(node.mask) for node in trace.nodes):
                out.append(trace)
    return out


def grpo_score_group(episodes: Sequence[vf.Episode]) -> None:
    traces = trainable_traces(episodes)
    rewards = np.array([trace.reward for trace in traces], dtype=np.float32)
    advantages = rewards - rewards.mean(dtype=np.float32)
    for trace, advantage in zip(traces, advantages.tolist(), strict=True):
        for node in trace.nodes:
            if any(node.mask):
                node.advantages = [float(advantage)] * sum(node.mask)


def _branch_masks(trace: vf.Trace) -> list[tuple[vf.Branch, list[bool]]]:
    trained: set[int] = set()
    out = []
    for branch in trace.branches:
        mask: list[bool] = []
        for node in branch.nodes:
            shared = node.sampled and any(node.mask)
            if shared and id(node) in trained:
                mask.extend([False] * len(node.mask))
                continue
            if shared:
                trained.add(id(node))
            mask.extend(node.mask)
        if any(mask) and branch.trainable:  # `trainable`: the 0.4.0 adaptation
            out.append((branch, mask))
    return out


def _stream(branch: vf.Branch, name: str, trained: set[int]) -> list[float] | None:
    weights: list[float] = []
    for node in branch.nodes:
        given = (node.loss_weights or {}).get(name)
        if given is None or id(node) in trained:
            weights.extend([0.0] * len(node.token_ids))
            continue
        assert len(given) == len(node.token_ids)
        weights.extend(given)
        if any(given):
            trained.add(id(node))
    return weights if any(weights) else None


def _experts(branch: vf.Branch) -> np.ndarray | None:
    rows = branch.routed_experts
    if rows is None:
        return None
    tokens = len(branch.token_ids)
    rows = np.ascontiguousarray(rows)[:tokens]
    if rows.shape[0] < tokens:
        rows = np.concatenate([rows, np.zeros((tokens - rows.shape[0], *rows.shape[1:]), rows.dtype)])
    return rows


def trace_samples(
    trace: vf.Trace, env_name: str, mapping: Mapping[int, int] | None = None
) -> list[PrimeSample]:
    samples = []
    trained = {"rl": set(), "ce": set(), "ref_kl": set()}  # type: dict[str, set[int]]
    for branch, mask in _branch_masks(trace):
        token_ids = branch.token_ids
        types = None
        if branch.mm_token_type_ids is not None:  # the 0.4.0 adaptation of multi_modal_data
            table = trace.mm_token_type_id_map if mapping is None else mapping
            types = [table.get(token, 0) for token in token_ids]
        samples.append(
            PrimeSample(
                token_ids=token_ids,
                mask=mask,
                logprobs=branch.logprobs,
                temperatures=[],
                env_name=env_name,
                ref_logprobs=branch.reference_logprobs,
                mm_token_type_ids=types,
                routed_experts=_experts(branch),
                rl_weights=_stream(branch, "rl", trained["rl"]),
                ce_weights=_stream(branch, "ce", trained["ce"]),
                ref_kl_weights=_stream(branch, "ref_kl", trained["ref_kl"]),
                advantages=branch.advantages,
            )
        )
    return samples


def _stamp(sample: PrimeSample, action_loss: str) -> None:
    if action_loss == "rl":
        return
    size = len(sample.token_ids)
    sample.rl_weights = [0.0] * size
    keep = action_loss == "ce" and sample.ce_weights is not None
    weights = sample.ce_weights if keep else [0.0] * size
    for index, trains in enumerate(sample.mask):
        if trains:
            weights[index] = 1.0
    if action_loss == "ce":
        sample.ce_weights = weights
    else:
        sample.ref_kl_weights = weights


def group_samples(
    episodes: Sequence[vf.Episode],
    temperature: float = 1.0,
    action_loss: str = "rl",
    mapping: Mapping[int, int] | None = None,
) -> list[PrimeSample]:
    """A completed group's samples, as `TrainSink.process_group` makes them with GRPO as the
    env's algorithm (applied only when no trace of the group carries advantages: a user's
    algorithm that assigned them stands in for it). The episodes are not changed."""
    episodes = [copy.deepcopy(episode) for episode in episodes]
    traces = trainable_traces(episodes)
    if not any(node.advantages is not None for trace in traces for node in trace.nodes) and traces:
        grpo_score_group(episodes)
    out = []
    for trace in traces:
        env_name = next(e.env.name for e in episodes if any(t is trace for t in e.traces))
        for sample in trace_samples(trace, env_name, mapping):
            sample.temperatures = [temperature] * len(sample.token_ids)
            _stamp(sample, action_loss)
            out.append(sample)
    return out


def errored_count(episodes: Sequence[vf.Episode]) -> int:
    """`process_group`'s `num_errored`."""
    traces = [trace for episode in episodes for trace in episode.traces]
    return sum(trace.has_error for trace in traces) + sum(
        not episode.ok for episode in episodes if not episode.traces
    )


def prune_zero_advantages(sample: PrimeSample) -> bool:
    """`train_sink._prune_zero_advantages`: whether the sample still ships; its rl weights
    zeroed where a trainable token has advantage 0."""
    if sample.advantages is None:
        return True
    weights = (
        [1.0 if t else 0.0 for t in sample.mask] if sample.rl_weights is None else list(sample.rl_weights)
    )
    changed = False
    for index, (trains, advantage, weight) in enumerate(
        zip(sample.mask, sample.advantages, weights, strict=True)
    ):
        if trains and advantage == 0.0 and weight != 0.0:
            weights[index] = 0.0
            changed = True
    if not changed:
        return True
    sample.rl_weights = weights
    has_rl = any(t and w != 0.0 for t, w in zip(sample.mask, weights, strict=True))
    has_ce = sample.ce_weights is not None and any(w != 0.0 for w in sample.ce_weights)
    has_ref_kl = sample.ref_kl_weights is not None and any(w != 0.0 for w in sample.ref_kl_weights)
    return has_rl or has_ce or has_ref_kl


class RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]
    dtype: str


class EncodedTensor(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes


class MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


_DECODER = msgspec.msgpack.Decoder(type=list[MicroBatch])


def decode_micro_batches(data: bytes) -> list[MicroBatch]:
    """A step's payload for one rank, as a 559b447 trainer rank decodes it."""
    return _DECODER.decode(data)


def routed_rows(batch: MicroBatch) -> np.ndarray | None:
    """The micro-batch's routed experts as a `[tokens, layers, topk]` array."""
    experts = batch.routed_experts
    if experts is None:
        return None
    return np.frombuffer(experts.data, dtype=experts.dtype).reshape(experts.shape)
