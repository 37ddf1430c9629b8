"""A checked trace's branches as per-token arrays (rlship's names: `docs/integrators.md`):
the trace's nodes are laid end to end once (token ids, sampled mask, and each per-node
stream spread onto its sampled positions), and every branch takes its tokens from those
arrays (a slice when its nodes lie in a row, as in every branch of a trace without forks),
so a node shared by several branches is converted from its Python lists once.

A sampled node shared by several branches (a fork) trains in the first branch holding it
only; a loss-weight stream weights a node in the first branch that weights it only; an
algorithm whose action tokens train another loss than `rl` has its action tokens weighted
in that stream instead (rlship.verifiers.conversion says what prime-rl does each after).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate, chain, repeat
from typing import Any, Literal

import numpy as np
import verifiers.v1 as vf

LOSS_STREAMS: tuple[str, ...] = ("rl", "ce", "ref_kl")
ActionLoss = Literal["rl", "ce", "ref_kl"]


class TraceLayout:
    """A trace's nodes end to end, in `trace.nodes` order: each node's first token and
    sampled count, the token ids, the sampled mask, and its per-node streams spread."""

    def __init__(self, trace: vf.Trace) -> None:
        nodes = trace.nodes
        self.nodes = nodes
        self.starts = [0, *accumulate(len(node.token_ids) for node in nodes)]
        total = self.starts[-1]
        self.token_ids = np.fromiter(chain.from_iterable(node.token_ids for node in nodes), np.int64, total)
        self.counts, self.sampled = _sampled(nodes, self.starts)
        self.positions = np.flatnonzero(self.sampled)
        self.logprobs = self.spread([node.logprobs for node in nodes])
        references = [node.reference_logprobs for node in nodes]
        advantages = [node.advantages for node in nodes]
        self.reference_logprobs = None if all(v is None for v in references) else self.spread(references)
        self.advantages = None if all(v is None for v in advantages) else self.spread(advantages)
        self.streams = any(node.loss_weights for node in nodes)

    def branches(self) -> list[tuple[int, list[int], bool]]:
        """The trace's branches as verifiers 0.4.0's `Trace.branches` makes them (one per
        leaf, root to leaf; a compaction attempt trains only if the harness resumed from it),
        by node place, without building its `Branch` objects: index, places, trainable."""
        nodes = self.nodes
        has_child = {node.parent for node in nodes if node.parent is not None}
        resumed = {link.node for node in nodes for link in node.semantic_parents if link.type == "compaction"}
        branches = []
        for index, leaf in enumerate(place for place in range(len(nodes)) if place not in has_child):
            path: list[int] = []
            place: int | None = leaf
            while place is not None:
                path.append(place)
                place = nodes[place].parent
            path.reverse()
            attempt = any(link.type == "compaction_attempt" for link in nodes[leaf].semantic_parents)
            branches.append((index, path, not attempt or leaf in resumed))
        return branches

    def spread(self, values: Sequence[Sequence[float] | None]) -> np.ndarray:
        """Per-node values over their sampled tokens, widened to the trace (0 elsewhere; a
        node with none reads 0)."""
        out = np.zeros(len(self.sampled), dtype=np.float32)
        given = (v if v else repeat(0.0, c) for v, c in zip(values, self.counts, strict=True) if c)
        out[self.positions] = np.fromiter(chain.from_iterable(given), np.float32, count=len(self.positions))
        return out

    def take(self, places: list[int]) -> slice | np.ndarray:
        """Where the tokens of the nodes at `places` (a branch's, in order) lie in the trace's
        arrays: a slice when they are in a row."""
        if not places:
            return slice(0, 0)
        first, last = places[0], places[-1]
        if last - first == len(places) - 1 and places == list(range(first, last + 1)):
            return slice(self.starts[first], self.starts[last + 1])
        return np.concatenate([np.arange(self.starts[p], self.starts[p + 1]) for p in places])


def _sampled(nodes: list[vf.MessageNode], starts: list[int]) -> tuple[list[int], np.ndarray]:
    """Each node's sampled count, and the sampled mask over the trace. A node's mask is read
    in C (a count and a search): one whose sampled tokens are its last ones (the layout
    verifiers makes: scaffold, then the completion) is filled as a slice."""
    sampled = np.zeros(starts[-1], dtype=bool)
    counts = []
    for node, end in zip(nodes, starts[1:], strict=True):
        mask = node.mask
        count = mask.count(True)
        counts.append(count)
        if not count:
            continue
        if mask.index(True) == len(mask) - count:
            sampled[end - count : end] = True
        else:
            sampled[end - len(mask) : end] = mask
    return counts, sampled


def trainable_mask(
    layout: TraceLayout, places: list[int], sampled: np.ndarray, trained: set[int]
) -> np.ndarray:
    """A branch's sampled mask, but a node trained in an earlier branch (`trained`, by place)
    is context here; the branch's sampled nodes join `trained`."""
    mask = sampled.copy()
    offset = 0
    for place in places:
        end = offset + layout.starts[place + 1] - layout.starts[place]
        if layout.counts[place] and layout.nodes[place].sampled:
            if place in trained:
                mask[offset:end] = False
            else:
                trained.add(place)
        offset = end
    return mask


def branch_arrays(
    trace: vf.Trace,
    layout: TraceLayout,
    places: list[int],
    take: slice | np.ndarray,
    mask: np.ndarray,
    weighted: dict[str, set[int]],
    action_loss: ActionLoss,
    mm_token_type_ids_mapping: Mapping[int, int] | None,
    advantage: float | None,
) -> dict[str, Any]:
    """One branch's per-token arrays."""
    token_ids = layout.token_ids[take]
    arrays: dict[str, Any] = {
        "input_ids": token_ids,
        "loss_mask": mask,
        "inference_logprobs": layout.logprobs[take],
    }
    if layout.reference_logprobs is not None:
        arrays["ref_logprobs"] = layout.reference_logprobs[take]
    if layout.advantages is not None:
        arrays["advantages"] = layout.advantages[take]
    elif advantage is not None:
        arrays["advantages"] = np.where(layout.sampled[take], np.float32(advantage), np.float32(0.0))
    nodes = [layout.nodes[place] for place in places]
    for stream in LOSS_STREAMS if layout.streams else ():
        weights = _stream_weights(nodes, stream, weighted[stream])
        if weights is not None:
            arrays[f"{stream}_weights"] = weights
    if action_loss != "rl":
        _route_action_loss(arrays, action_loss)
    experts = [node.routed_experts for node in nodes if node.token_ids]
    if experts and all(rows is not None for rows in experts):
        arrays["routed_experts"] = np.ascontiguousarray(np.concatenate(experts, axis=0))
    mapping = trace.mm_token_type_id_map if mm_token_type_ids_mapping is None else mm_token_type_ids_mapping
    if mapping:
        types = np.array([mapping.get(int(token), 0) for token in token_ids.tolist()], dtype=np.int64)
        if types.any():
            arrays["mm_token_type_ids"] = types
    return arrays


def _stream_weights(nodes: list[vf.MessageNode], stream: str, weighted: set[int]) -> np.ndarray | None:
    """A loss-weight stream over a branch's nodes, each node weighted in the first branch that
    weights it only; None when the branch has no non-zero weight of it."""
    parts = []
    for node in nodes:
        node_weights = (node.loss_weights or {}).get(stream)
        if node_weights is None or id(node) in weighted:
            parts.append(np.zeros(len(node.token_ids), dtype=np.float32))
            continue
        parts.append(np.asarray(node_weights, dtype=np.float32))
        if any(node_weights):
            weighted.add(id(node))
    weights = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
    return weights if weights.any() else None


def _route_action_loss(arrays: dict[str, Any], action_loss: ActionLoss) -> None:
    """An algorithm whose action tokens train another loss than `rl` (SFT's `ce`, OPD's
    `ref_kl`): no rl weight anywhere, weight 1.0 on the trainable tokens in its stream."""
    mask = arrays["loss_mask"]
    arrays["rl_weights"] = np.zeros(len(mask), dtype=np.float32)
    name = f"{action_loss}_weights"
    base = arrays.get(name) if action_loss == "ce" else None
    weights = np.zeros(len(mask), dtype=np.float32) if base is None else base.copy()
    weights[mask] = 1.0
    arrays[name] = weights
