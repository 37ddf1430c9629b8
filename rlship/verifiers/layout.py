"""A group's checked traces as per-token arrays (rlship's names: `docs/integrators.md`): the
nodes of all its trainable traces are laid end to end once (token ids, sampled mask, and
each per-node stream spread onto its sampled positions, the group's credit with them), and
every branch takes its tokens from those arrays (a slice when its nodes lie in a row, as in
every branch of a trace without forks). So a node shared by several branches is converted
from its Python lists once, and a group's lists become arrays in one call per stream, not
one a node or a branch.

A sampled node shared by several branches (a fork) trains in the first branch holding it
only; a loss-weight stream weights a node in the first branch that weights it only; an
algorithm whose action tokens train another loss than `rl` has its action tokens weighted
in that stream instead (rlship.verifiers.conversion says what prime-rl does each after).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import accumulate, chain, pairwise, repeat
from typing import Any, Literal

import numpy as np
import verifiers.v1 as vf

LOSS_STREAMS: tuple[str, ...] = ("rl", "ce", "ref_kl")
ActionLoss = Literal["rl", "ce", "ref_kl"]
Made = tuple[int, dict[str, Any], int]  # a branch's index in its trace, arrays, output tokens


class GroupLayout:
    """The nodes of a group's traces end to end, trace after trace, by place in the group
    (`first[t]`: trace t's first node): each node's first token (`starts`) and sampled count,
    the sampled mask, and the sampled tokens before each token. The masks are laid out at
    once, so that the nodes can be checked against them (`aligned`); `fill` lays out the
    other streams, which takes nodes aligned with their token ids."""

    def __init__(self, traces: Sequence[vf.Trace]) -> None:
        self.traces = traces
        self.nodes = [node for trace in traces for node in trace.nodes]
        self.first = [0, *accumulate(len(trace.nodes) for trace in traces)]
        masks = bytearray()  # a mask is a list of bools: its bytes are the bool array
        for node in self.nodes:
            masks.extend(node.mask)
        self.sampled = np.frombuffer(masks, dtype=bool)
        self.starts = [0, *accumulate(len(node.mask) for node in self.nodes)]
        self.before = np.concatenate(([0], np.cumsum(self.sampled)))
        self.counts: list[int] = (self.before[self.starts[1:]] - self.before[self.starts[:-1]]).tolist()
        # each trace's sampled tokens
        self.traces_sampled: list[int] = np.diff(
            self.before[[self.starts[place] for place in self.first]]
        ).tolist()

    def aligned(self) -> bool:
        """Whether every node is aligned with its token ids and every trace has some: all of
        what rlship.verifiers.conversion's `_trace_problems` checks, a stream at a time over
        the group (when not, it checks the traces one by one, naming each problem)."""
        nodes, counts, starts = self.nodes, self.counts, self.starts
        if [len(node.token_ids) for node in nodes] != [b - a for a, b in pairwise(starts)]:
            return False
        if any(a < b and starts[a] == starts[b] for a, b in pairwise(self.first)):
            return False  # a trace with nodes and no token ids
        for values in (
            [node.logprobs for node in nodes],
            [node.advantages for node in nodes],
            [node.reference_logprobs for node in nodes],
        ):
            if any(v is not None and c and len(v) != c for v, c in zip(values, counts, strict=True)):
                return False
        for node in (node for node in nodes if node.loss_weights or node.routed_experts is not None):
            streams, experts = node.loss_weights, node.routed_experts
            if streams and any(
                name not in LOSS_STREAMS or len(weights) != len(node.token_ids)
                for name, weights in streams.items()
            ):
                return False
            if experts is not None and (experts.ndim != 3 or len(experts) != len(node.token_ids)):
                return False
        return True

    def fill(self, credit: Sequence[float | None]) -> None:
        """Lay out the token ids and the per-node streams of aligned nodes; `credit` is each
        trace's advantage to broadcast over its sampled tokens (None: none), which a trace
        carrying its algorithm's own per-node advantages takes instead."""
        nodes = self.nodes
        self.token_ids = np.fromiter(
            chain.from_iterable(node.token_ids for node in nodes), np.int64, self.starts[-1]
        )
        self.positions = np.flatnonzero(self.sampled)
        self.logprobs = self._spread(node.logprobs for node in nodes)
        self.refs = self._traces_with(lambda node: node.reference_logprobs is not None)
        references = (node.reference_logprobs for node in nodes)
        self.reference_logprobs = self._spread(references) if any(self.refs) else None
        given = self._traces_with(lambda node: node.advantages is not None)
        self.credited = [own or value is not None for own, value in zip(given, credit, strict=True)]
        self.advantages = self._credit(given, credit) if any(self.credited) else None
        self.streams = self._traces_with(lambda node: bool(node.loss_weights))
        self.routed = self._traces_with(lambda node: node.routed_experts is not None)

    def _traces_with(self, has: Callable[[vf.MessageNode], bool]) -> list[bool]:
        """Whether each trace has a node that `has` it (the group's nodes looked at first: in
        most groups none has)."""
        if not any(map(has, self.nodes)):
            return [False] * len(self.traces)
        return [any(map(has, trace.nodes)) for trace in self.traces]

    def _credit(self, given: list[bool], credit: Sequence[float | None]) -> np.ndarray:
        """The advantages over the group: a trace's own per node, else its advantage on each
        of its sampled tokens (0 elsewhere, and where a trace has none)."""
        if any(given):
            values = (
                node.advantages if given[trace] else repeat(credit[trace] or 0.0, count)
                for trace, (lo, hi) in enumerate(pairwise(self.first))
                for node, count in zip(self.nodes[lo:hi], self.counts[lo:hi], strict=True)
            )
            return self._spread(values)
        lengths = np.diff([self.starts[place] for place in self.first])
        each = np.repeat(np.array([value or 0.0 for value in credit], dtype=np.float32), lengths)
        return np.where(self.sampled, each, np.float32(0.0))

    def _spread(self, values: Iterable[Iterable[float] | None]) -> np.ndarray:
        """Per-node values over their sampled tokens, widened to the group (0 elsewhere; a
        node with none reads 0)."""
        out = np.zeros(len(self.sampled), dtype=np.float32)
        given = (v if v else repeat(0.0, c) for v, c in zip(values, self.counts, strict=True) if c)
        out[self.positions] = np.fromiter(chain.from_iterable(given), np.float32, count=len(self.positions))
        return out

    def rollouts(
        self, trace: int, action_loss: ActionLoss, mm_token_type_ids_mapping: Mapping[int, int] | None
    ) -> list[Made]:
        """Trace `trace`'s rollouts, one per trainable branch with a token left to train:
        index, arrays, and how many of its tokens were sampled. Its branches are verifiers
        0.4.0's `Trace.branches` (one per leaf, root to leaf; a compaction attempt trains only
        if the harness resumed from it), by node place, without building its `Branch`
        objects; a trace whose nodes are a chain in order is one branch of them all."""
        nodes = self.traces[trace].nodes
        offset = self.first[trace]
        mapping = self.traces[trace].mm_token_type_id_map
        mapping = mapping if mm_token_type_ids_mapping is None else mm_token_type_ids_mapping
        weighted: dict[str, set[int]] = {stream: set() for stream in LOSS_STREAMS}
        parents = [node.parent for node in nodes]
        if parents[:1] == [None] and parents[1:] == list(range(len(nodes) - 1)):
            output = self.traces_sampled[trace]
            if not output or not _trains(nodes, len(nodes) - 1):
                return []
            places = range(offset, offset + len(nodes))
            take = slice(self.starts[offset], self.starts[offset + len(nodes)])
            arrays = self._arrays(trace, places, take, self.sampled[take], weighted, action_loss, mapping)
            return [(0, arrays, output)]
        has_child = set(parents)
        trained: set[int] = set()  # sampled nodes trained in an earlier branch (by place)
        made = []
        for index, leaf in enumerate(place for place in range(len(nodes)) if place not in has_child):
            if not _trains(nodes, leaf):
                continue
            path: list[int] = []
            place: int | None = leaf
            while place is not None:
                path.append(place + offset)
                place = parents[place]
            path.reverse()
            take = self._take(path)
            mask = self._trainable_mask(path, self.sampled[take], trained)
            if not mask.any():
                continue
            output = sum(self.counts[place] for place in path)
            made.append(
                (index, self._arrays(trace, path, take, mask, weighted, action_loss, mapping), output)
            )
        return made

    def _take(self, places: list[int]) -> slice | np.ndarray:
        """Where the tokens of the nodes at `places` (a branch's, in order) lie in the group's
        arrays: a slice when they are in a row."""
        first, last = places[0], places[-1]
        if last - first == len(places) - 1 and places == list(range(first, last + 1)):
            return slice(self.starts[first], self.starts[last + 1])
        return np.concatenate([np.arange(self.starts[p], self.starts[p + 1]) for p in places])

    def _trainable_mask(self, places: list[int], sampled: np.ndarray, trained: set[int]) -> np.ndarray:
        """A branch's sampled mask, but a node trained in an earlier branch (`trained`) is
        context here; the branch's sampled nodes join `trained`."""
        mask = sampled
        offset = 0
        for place in places:
            end = offset + self.starts[place + 1] - self.starts[place]
            if self.counts[place] and self.nodes[place].sampled:
                if place in trained:
                    if mask is sampled:
                        mask = sampled.copy()
                    mask[offset:end] = False
                else:
                    trained.add(place)
            offset = end
        return mask

    def _arrays(
        self,
        trace: int,
        places: Sequence[int],
        take: slice | np.ndarray,
        mask: np.ndarray,
        weighted: dict[str, set[int]],
        action_loss: ActionLoss,
        mapping: Mapping[int, int] | None,
    ) -> dict[str, Any]:
        """One branch's per-token arrays (views of the group's where its tokens are in a row)."""
        token_ids = self.token_ids[take]
        arrays: dict[str, Any] = {
            "input_ids": token_ids,
            "loss_mask": mask,
            "inference_logprobs": self.logprobs[take],
        }
        if self.refs[trace]:
            arrays["ref_logprobs"] = self.reference_logprobs[take]  # type: ignore[index]  # refs
        if self.credited[trace]:
            arrays["advantages"] = self.advantages[take]  # type: ignore[index]  # credited
        nodes = [self.nodes[place] for place in places] if self.streams[trace] or self.routed[trace] else []
        for stream in LOSS_STREAMS if self.streams[trace] else ():
            weights = _stream_weights(nodes, stream, weighted[stream])
            if weights is not None:
                arrays[f"{stream}_weights"] = weights
        if action_loss != "rl":
            _route_action_loss(arrays, action_loss)
        experts = [node.routed_experts for node in nodes if node.token_ids]
        if experts and all(rows is not None for rows in experts):
            arrays["routed_experts"] = np.ascontiguousarray(np.concatenate(experts, axis=0))
        if mapping:
            types = np.array([mapping.get(int(token), 0) for token in token_ids.tolist()], dtype=np.int64)
            if types.any():
                arrays["mm_token_type_ids"] = types
        return arrays


def _trains(nodes: list[vf.MessageNode], leaf: int) -> bool:
    """Whether the branch ending at `leaf` trains: it is not a compaction attempt, or it is
    one the harness resumed from."""
    if not any(link.type == "compaction_attempt" for link in nodes[leaf].semantic_parents):
        return True
    return leaf in {
        link.node for node in nodes for link in node.semantic_parents if link.type == "compaction"
    }


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
