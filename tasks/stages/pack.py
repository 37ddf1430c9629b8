"""Pack: samples into micro-batches of at most `seq_len` tokens, the same number per rank,
balanced across ranks by token count.

1. First-fit decreasing fills micro-batches (few micro-batches, little waste).
2. Micro-batches are split (the largest splittable first) until their number is a
   non-zero multiple of the rank count; when nothing can be split, padding micro-batches
   fill the grid, so every rank runs the same number of steps of its optimizer loop.
3. Karmarkar-Karp differencing with equal cardinality assigns them to ranks: it merges
   partial partitions largest-spread first, pairing the heaviest set of one with the
   lightest of the other, which balances token counts far better than round-robin.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np


@dataclass
class MicroBatchPlan:
    """Sample positions (into the pruned cohort) of one micro-batch, and padding tokens
    appended to reach the requested multiple."""

    samples: list[int]
    tokens: int
    padding: int = 0

    @property
    def total_tokens(self) -> int:
        return self.tokens + self.padding


@dataclass
class PackPlan:
    ranks: list[list[MicroBatchPlan]] = field(default_factory=list)

    def rank_tokens(self) -> list[int]:
        return [sum(mb.total_tokens for mb in rank) for rank in self.ranks]

    def to_wire(self) -> list[list[list[int]]]:
        return [[[mb.tokens, mb.padding, *mb.samples] for mb in rank] for rank in self.ranks]

    @classmethod
    def from_wire(cls, data: list[list[list[int]]]) -> PackPlan:
        return cls(
            [
                [MicroBatchPlan(samples=list(mb[2:]), tokens=mb[0], padding=mb[1]) for mb in rank]
                for rank in data
            ]
        )


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[MicroBatchPlan]:
    """Bins of total length <= capacity, longest samples placed first."""
    if len(lengths) and int(lengths.max()) > capacity:
        raise ValueError(f"sample length {int(lengths.max())} exceeds seq_len {capacity}")
    bins: list[MicroBatchPlan] = []
    for index in np.argsort(-lengths, kind="stable"):
        length = int(lengths[index])
        for mb in bins:
            if mb.tokens + length <= capacity:
                mb.samples.append(int(index))
                mb.tokens += length
                break
        else:
            bins.append(MicroBatchPlan(samples=[int(index)], tokens=length))
    return bins


def _split(mb: MicroBatchPlan, lengths: np.ndarray) -> tuple[MicroBatchPlan, MicroBatchPlan]:
    """Split a micro-batch into two of near-equal tokens (greedy on descending lengths)."""
    halves = (MicroBatchPlan([], 0), MicroBatchPlan([], 0))
    for index in sorted(mb.samples, key=lambda i: -int(lengths[i])):
        target = min(halves, key=lambda h: h.tokens)
        target.samples.append(index)
        target.tokens += int(lengths[index])
    return halves


def split_to_multiple(bins: list[MicroBatchPlan], lengths: np.ndarray, ranks: int) -> list[MicroBatchPlan]:
    """Split or pad until the number of micro-batches is a non-zero multiple of `ranks`."""
    bins = list(bins)
    while len(bins) < ranks or len(bins) % ranks:
        splittable = [mb for mb in bins if len(mb.samples) > 1]
        if not splittable:
            bins.extend(MicroBatchPlan([], 0) for _ in range(-len(bins) % ranks or ranks))
            break
        largest = max(splittable, key=lambda mb: mb.tokens)
        bins.remove(largest)
        bins.extend(_split(largest, lengths))
    return bins


def karmarkar_karp(bins: list[MicroBatchPlan], ranks: int) -> list[list[MicroBatchPlan]]:
    """Assign micro-batches to `ranks` sets of equal size with balanced token sums."""
    ordered = sorted(bins, key=lambda mb: -mb.total_tokens)
    heap: list[tuple[int, int, list[tuple[int, list[MicroBatchPlan]]]]] = []
    for counter, start in enumerate(range(0, len(ordered), ranks)):
        chunk = ordered[start : start + ranks]
        partition = sorted(((mb.total_tokens, [mb]) for mb in chunk), key=lambda s: -s[0])
        heapq.heappush(heap, (-(partition[0][0] - partition[-1][0]), counter, partition))
    counter = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [
            (a_sum + b_sum, a_items + b_items)
            for (a_sum, a_items), (b_sum, b_items) in zip(first, reversed(second), strict=True)
        ]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [items for _, items in heap[0][2]] if heap else [[] for _ in range(ranks)]


def pack_samples(lengths: np.ndarray, ranks: int, seq_len: int, pad_to_multiple: int = 1) -> PackPlan:
    """The whole packing stage: FFD, split to a multiple of ranks, pad, balance."""
    if ranks < 1:
        raise ValueError(f"ranks: {ranks}, expected >= 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    bins = split_to_multiple(first_fit_decreasing(lengths, seq_len), lengths, ranks)
    for mb in bins:
        mb.padding = -mb.tokens % pad_to_multiple if mb.tokens else pad_to_multiple
    plan = PackPlan(karmarkar_karp(bins, ranks))
    for rank in plan.ranks:
        rank.sort(key=lambda mb: min(mb.samples, default=len(lengths)))
    return plan
