"""The packing stage held to exact placements, without a broker.

Two oracles, neither of which calls `tasks.stages.pack` to compute what it expects:
- small examples worked out by hand in the comments beside them (every step of first-fit
  decreasing, the split, Karmarkar-Karp's merges, the move or swap the local search picks);
- `Reference` (tests.support.pack_reference), a second implementation in plain Python
  lists written from the module's docstring (no numpy), compared placement for placement on
  random inputs, with many equal lengths so that every tie-break is exercised: which
  micro-batch a sample goes to, in what order, on which rank, with what padding, is what
  the encoder turns into the wire.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tasks.stages.pack import (
    MicroBatchPlan,
    PackPlan,
    _best_move_or_swap,
    _best_swap,
    _split,
    first_fit_decreasing,
    karmarkar_karp,
    pack_samples,
    rebalance,
    split_to_multiple,
)
from tests.support.pack_reference import Reference


def mb(samples: list[int], tokens: int) -> MicroBatchPlan:
    return MicroBatchPlan(list(samples), tokens)


def shape(bins: list[MicroBatchPlan]) -> list[tuple[list[int], int]]:
    return [(b.samples, b.tokens) for b in bins]


def placement(ranks: list[list[MicroBatchPlan]]) -> list[list[tuple[list[int], int, int]]]:
    return [[(b.samples, b.tokens, b.padding) for b in rank] for rank in ranks]


# ---------------------------------------------------------------------------------------------
# First-fit decreasing


def test_ffd_fills_a_bin_exactly_to_capacity_longest_first():
    # lengths 3,1,2,2 (capacity 4), longest first: #0 (3) opens bin A; #2 (2) does not fit A
    # (5) and opens B; #3 (2) fits B exactly (4); #1 (1) fits A exactly (4).
    assert shape(first_fit_decreasing(np.array([3, 1, 2, 2]), 4)) == [([0, 1], 4), ([2, 3], 4)]


def test_ffd_takes_equal_lengths_in_index_order():
    # 40 samples of length 2 in bins of 4: pairs in index order, whatever the sort would do.
    bins = first_fit_decreasing(np.full(40, 2), 4)
    assert shape(bins) == [([2 * k, 2 * k + 1], 4) for k in range(20)]


def test_ffd_places_ties_like_a_stable_sort_on_many_random_lengths():
    rng = random.Random(3)
    lengths = [rng.randint(1, 4) for _ in range(120)]
    bins = first_fit_decreasing(np.array(lengths), 7)
    assert [(b.samples, b.tokens) for b in bins] == [(b[0], b[1]) for b in Reference.ffd(lengths, 7)]


# ---------------------------------------------------------------------------------------------
# Split to a multiple of the rank count


def test_split_halves_greedily_from_the_longest_sample():
    # lengths of #0..#3: 1, 4, 3, 2; longest first: #1 (4) -> A; #2 (3) -> B (lighter, 0);
    # #3 (2) -> B (3 < 4): 5; #0 (1) -> A (4 < 5): 5.
    one, two = _split(mb([0, 1, 2, 3], 10), np.array([1, 4, 3, 2]))
    assert shape([one, two]) == [([1, 0], 5), ([2, 3], 5)]


def test_split_to_multiple_leaves_a_multiple_alone():
    bins = [mb([0, 1], 4), mb([2, 3], 4)]
    assert shape(split_to_multiple(bins, np.array([2, 2, 2, 2]), 2)) == [([0, 1], 4), ([2, 3], 4)]
    three = [mb([0, 1], 2), mb([2, 3], 2), mb([4, 5], 2)]
    assert shape(split_to_multiple(three, np.ones(6, dtype=np.int64), 3)) == shape(three)


def test_split_to_multiple_splits_a_two_sample_bin_rather_than_pad():
    # One bin of two samples for two ranks: split into #0 (3) and #1 (2), no padding bin.
    assert shape(split_to_multiple([mb([0, 1], 5)], np.array([3, 2]), 2)) == [([0], 3), ([1], 2)]


def test_split_to_multiple_splits_the_largest_bin_with_two_samples_never_a_single_sample():
    # Three ranks: the single sample #0 (10 tokens) cannot be split; [#1, #2] (6) is.
    bins = [mb([0], 10), mb([1, 2], 6)]
    assert shape(split_to_multiple(bins, np.array([10, 3, 3]), 3)) == [([0], 10), ([1], 3), ([2], 3)]


def test_split_to_multiple_pads_with_empty_bins_when_nothing_splits():
    lengths = np.array([5, 4, 3])
    assert shape(split_to_multiple([mb([0], 5)], lengths, 3)) == [([0], 5), ([], 0), ([], 0)]
    three = [mb([0], 5), mb([1], 4), mb([2], 3)]
    assert shape(split_to_multiple(three, lengths, 2)) == [([0], 5), ([1], 4), ([2], 3), ([], 0)]
    assert shape(split_to_multiple([], lengths, 2)) == [([], 0), ([], 0)]


def test_split_to_multiple_splits_the_largest_first_until_the_count_is_a_multiple():
    # Four ranks, two bins: [#0 #1 #2] (9: 4+3+2) is the largest -> [#0] 4, [#1 #2] 5; now
    # three bins, the largest splittable is [#1 #2] (5) -> [#1] 3, [#2] 2.
    lengths = np.array([4, 3, 2, 1, 1])
    bins = [mb([0, 1, 2], 9), mb([3, 4], 2)]
    assert shape(split_to_multiple(bins, lengths, 4)) == [([3, 4], 2), ([0], 4), ([1], 3), ([2], 2)]


# ---------------------------------------------------------------------------------------------
# Karmarkar-Karp


def test_karmarkar_karp_pairs_the_heaviest_with_the_lightest_of_the_other_partition():
    # 8, 6, 3, 1 on two ranks: partitions (8 | 6) and (3 | 1), spread 2 each; the older (8 | 6)
    # is popped first and merged with (3 | 1) reversed: 8+1, 6+3.
    a, b, c, d = mb([0], 8), mb([1], 6), mb([2], 3), mb([3], 1)
    assert karmarkar_karp([c, a, d, b], 2) == [[a, d], [b, c]]


def test_karmarkar_karp_merges_the_widest_spread_first():
    # 10, 9, 5, 4, 4, 1 on two ranks: partitions P0 (10 | 9) spread 1, P1 (5 | 4) spread 1,
    # P2 (4 | 1) spread 3. Widest first: P2 with P0 (the older of the spread-1 pair):
    # 4+9 = 13, 1+10 = 11 -> P3 (13 | 11) spread 2. Then P3 with P1 reversed: 13+4, 11+5.
    m = [mb([k], t) for k, t in enumerate([10, 9, 5, 4, 4, 1])]
    assert karmarkar_karp(m, 2) == [[m[4], m[1], m[3]], [m[5], m[0], m[2]]]


def test_karmarkar_karp_of_nothing_is_empty_ranks():
    assert karmarkar_karp([], 3) == [[], [], []]


def test_karmarkar_karp_refuses_a_count_that_is_not_a_multiple_rather_than_lose_one():
    with pytest.raises(ValueError):
        karmarkar_karp([mb([0], 3), mb([1], 2), mb([2], 1)], 2)


# ---------------------------------------------------------------------------------------------
# The local search: moves and swaps


def test_best_move_moves_one_sample_to_the_lightest_rank():
    # gap 2 (2 vs 0): moving a 1-token sample makes it 0; the first candidate (#0) is taken.
    heavy, light = [mb([0, 1], 2)], [mb([], 0)]
    assert _best_move_or_swap(heavy, light, np.array([1, 1]), 4, 2) == (2, (heavy[0], 0, light[0], None))


def test_rebalance_moves_across_a_gap_of_two():
    ranks = [[mb([0, 1], 2)], [mb([], 0)]]
    rebalance(ranks, np.array([1, 1]), 4)
    assert [[(b.samples, b.tokens) for b in r] for r in ranks] == [[([1], 1)], [([0], 1)]]


def test_best_move_may_fill_a_micro_batch_exactly_to_capacity():
    # Heavy 8 (two bins of 2+2), light 2 (one sample of 2, room 2 of 4); gap 6. Moving a
    # 2-token sample fits exactly and leaves a gap of 2: gain 4.
    heavy, light = [mb([0, 1], 4), mb([3, 4], 4)], [mb([2], 2)]
    lengths = np.array([2, 2, 2, 2, 2])
    assert _best_move_or_swap(heavy, light, lengths, 4, 6) == (4, (heavy[0], 0, light[0], None))


def test_best_swap_when_no_move_fits():
    # Capacity 6. Heavy: [#0 #1], [#2 #3], [#8 #9], all 3+3: 18. Light: [#4 #5] 2+3 (room 1)
    # and [#6 #7] 3+3 (room 0): 11. Gap 7. No 3-token move fits anywhere; swapping #0 (3) for
    # #4 (2) moves one token into room 1 exactly: gap 7 -> 5, gain 2. Then (17 vs 12) nothing
    # fits and no swap moves a positive amount: done.
    lengths = np.array([3, 3, 3, 3, 2, 3, 3, 3, 3, 3])
    heavy = [mb([0, 1], 6), mb([2, 3], 6), mb([8, 9], 6)]
    light = [mb([4, 5], 5), mb([6, 7], 6)]
    assert _best_move_or_swap(heavy, light, lengths, 6, 7) == (2, (heavy[0], 0, light[0], 4))
    ranks = [heavy, light]
    rebalance(ranks, lengths, 6)
    assert [[(b.samples, b.tokens) for b in r] for r in ranks] == [
        [([1, 4], 5), ([2, 3], 6), ([8, 9], 6)],
        [([5, 0], 6), ([6, 7], 6)],
    ]


def test_best_prefers_a_move_over_an_equally_good_swap():
    # Capacity 10. Heavy [#0 #1] 5+5 = 10; light [#2] 2 (room 8); gap 8. Moving a 5: gap 8 -> 2,
    # gain 6. Swapping a 5 for #2 moves 3: gap 8 -> 2, gain 6 too: the move is kept.
    heavy, light = [mb([0, 1], 10)], [mb([2], 2)]
    assert _best_move_or_swap(heavy, light, np.array([5, 5, 2]), 10, 8) == (6, (heavy[0], 0, light[0], None))


def test_best_prefers_a_better_move_over_a_worse_swap():
    # Capacity 10. Heavy [#0 #1] 2+8 = 10; light [#2 #3] 3+1 = 4 (room 6); gap 6. Moving #0 (2):
    # gap 2, gain 4; #1 (8) does not fit. Swaps: #1 for #2 moves 5: |6 - 10| = 4, gain 2; #1
    # for #3 moves 7 (no room); #0 for #3 moves 1: gain 2. The move wins.
    heavy, light = [mb([0, 1], 10)], [mb([2, 3], 4)]
    lengths = np.array([2, 8, 3, 1])
    assert _best_move_or_swap(heavy, light, lengths, 10, 6) == (4, (heavy[0], 0, light[0], None))


def test_best_swap_of_an_odd_gap_takes_the_first_destination_of_either_delta():
    # Gap 3: moving 1 token leaves |3 - 2| = 1, moving 2 leaves |3 - 4| = 1: both gain 2.
    # Source length 10 against destinations of 8 (delta 2) and 9 (delta 1): the first
    # destination wins, whichever delta it takes.
    rooms = np.array([5, 5])
    assert _best_swap(np.array([10]), np.array([8, 9]), rooms, 3) == (2, 0, 0)
    assert _best_swap(np.array([10]), np.array([9, 8]), rooms, 3) == (2, 0, 0)
    # The first destination's micro-batch has room for 1 token: delta 2 does not fit there.
    assert _best_swap(np.array([10]), np.array([8, 9]), np.array([1, 5]), 3) == (2, 0, 1)
    # A later source that reaches the peak does not beat an earlier one that does.
    assert _best_swap(np.array([12, 10]), np.array([8, 11]), rooms, 3) == (2, 0, 1)
    # Nothing fits (every delta above its room, or not positive): no swap.
    assert _best_swap(np.array([10, 3]), np.array([5, 10]), np.array([2, 9]), 3) is None


def test_best_swap_looks_on_both_sides_of_half_the_gap():
    # Gap 4, destination 7 (room 5): source 6 moves -1 tokens (no swap), source 10 moves 3,
    # past the peak at 2, leaving |4 - 6| = 2: gain 2, the only swap there is.
    assert _best_swap(np.array([6, 10]), np.array([7]), np.array([5]), 4) == (2, 1, 0)
    # Gap 20, destination 10 (room 20): source 18 moves 8 (gain 16), source 21 moves 11
    # (|20 - 22| = 2 left: gain 18). The one just past the peak beats the nearest below it.
    assert _best_swap(np.array([18, 21]), np.array([10]), np.array([20]), 20) == (18, 1, 0)
    # Gap 20, destination 10 (room 30): the smallest source, 11, moves 1 (gain 2); 30 moves
    # 20, past the whole gap (gain 0). The best is the first of the sorted lengths.
    assert _best_swap(np.array([11, 30]), np.array([10]), np.array([30]), 20) == (2, 0, 0)


def test_best_is_none_when_nothing_narrows_the_gap():
    # Gap 2 between [#0 #1] 3+3 and [#2] 4: moving 3 leaves |2 - 6| = 4 (worse); swapping a 3
    # for the 4 moves -1 (not heavy to light). Nothing: None, not a zero or negative gain.
    lengths = np.array([3, 3, 4])
    assert _best_move_or_swap([mb([0, 1], 6)], [mb([2], 4)], lengths, 10, 2) is None
    # Gap 2 between [#0 #1] 2+2 and [#2] 2 (capacity 4, room 2): moving a 2 fits exactly but
    # leaves |2 - 4| = 2, gain 0; swapping equal lengths moves nothing. None again.
    lengths = np.array([2, 2, 2])
    assert _best_move_or_swap([mb([0, 1], 4)], [mb([2], 2)], lengths, 4, 2) is None


def test_rebalance_never_takes_the_last_sample_of_a_micro_batch():
    # Heavy: [#0] 1 and [#1] 3 (4); light: an empty padding bin; gap 4. Moving either sample
    # would narrow the gap, but each is alone in its micro-batch: nothing moves.
    heavy, light = [mb([0], 1), mb([1], 3)], [mb([], 0)]
    assert _best_move_or_swap(heavy, light, np.array([1, 3]), 8, 4) is None
    ranks = [heavy, light]
    rebalance(ranks, np.array([1, 3]), 8)
    assert [[b.samples for b in r] for r in ranks] == [[[0], [1]], [[]]]


def test_rebalance_stops_after_256_moves():
    # 600 one-token samples in one micro-batch against an empty one: each round moves one
    # sample (gain 2); after 256 rounds the gap is 600 - 2 * 256 = 88.
    ranks = [[mb(list(range(600)), 600)], [mb([], 0)]]
    rebalance(ranks, np.ones(600, dtype=np.int64), 1000)
    assert ranks[0][0].tokens == 600 - 256 and ranks[1][0].tokens == 256
    assert ranks[1][0].samples == list(range(256))


# ---------------------------------------------------------------------------------------------
# The whole stage


def test_pack_samples_default_pads_nothing():
    plan = pack_samples(np.array([3]), ranks=1, seq_len=8)
    assert placement(plan.ranks) == [[([0], 3, 0)]]


def test_pack_samples_pads_an_empty_micro_batch_to_one_multiple():
    # One sample of 3 on two ranks, multiples of 4: rank 0 [#0] 3 + 1 padding; rank 1 a
    # padding micro-batch of 4 tokens (a rank never runs an empty step).
    plan = pack_samples(np.array([3]), ranks=2, seq_len=8, pad_to_multiple=4)
    assert placement(plan.ranks) == [[([0], 3, 1)], [([], 0, 4)]]
    assert plan.rank_tokens() == [4, 4]


def test_pack_samples_puts_a_rank_s_padding_micro_batch_last():
    # Three samples of 5 (seq_len 5) on two ranks: three bins and one padding bin. KK:
    # partitions ([#0] | [#1]) spread 0 and ([#2] | pad) spread 5; the wider first, merged with
    # the other reversed: [#2]+[#1] = 10, pad+[#0] = 5. Nothing moves (single-sample bins).
    # Each rank sorted by its first sample, the padding bin last; padding 1 token (a multiple of 1).
    plan = pack_samples(np.array([5, 5, 5]), ranks=2, seq_len=5)
    assert placement(plan.ranks) == [[([1], 5, 0), ([2], 5, 0)], [([0], 5, 0), ([], 0, 1)]]


def test_pack_samples_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^ranks: 0, expected >= 1$"):
        pack_samples(np.array([1]), ranks=0, seq_len=8)
    with pytest.raises(ValueError, match=r"^pad_to_multiple: 3 does not divide seq_len 8$"):
        pack_samples(np.array([1]), ranks=1, seq_len=8, pad_to_multiple=3)


@pytest.mark.parametrize("seed", range(40))
def test_pack_samples_places_every_sample_as_the_reference_does(seed):
    rng = random.Random(seed)
    ranks = rng.choice([1, 2, 3, 4, 8])
    seq_len = rng.choice([16, 32, 64])
    pad = rng.choice([d for d in (1, 2, 4, 8) if seq_len % d == 0])
    n = rng.randint(0, 60)
    # Few distinct lengths, so ties everywhere; sometimes all short (many samples per bin).
    top = rng.choice([4, seq_len // 2, seq_len])
    lengths = [rng.choice(sorted({1, 2, 3, top // 2 or 1, top})) for _ in range(n)]
    plan = pack_samples(np.array(lengths, dtype=np.int64), ranks, seq_len, pad_to_multiple=pad)
    assert placement(plan.ranks) == Reference.pack(lengths, ranks, seq_len, pad)


def rebalances_as_the_reference_does(ref: list[list[list]], lengths: list[int], capacity: int) -> None:
    """`rebalance` and the reference's, each from the same ranks (`ref`, as the reference's
    lists), end with the same micro-batches."""
    ranks = [[mb(b[0], b[1]) for b in rank] for rank in ref]
    rebalance(ranks, np.array(lengths, dtype=np.int64), capacity)
    Reference.rebalance(ref, lengths, capacity)
    assert [[(b.samples, b.tokens) for b in r] for r in ranks] == [[(b[0], b[1]) for b in r] for r in ref]


@pytest.mark.parametrize("seed", range(30))
def test_rebalance_moves_and_swaps_as_the_reference_does(seed):
    rng = random.Random(1000 + seed)
    capacity = 32
    lengths = [rng.randint(1, 12) for _ in range(rng.randint(4, 40))]
    ranks_n = rng.choice([2, 3, 4])
    # Random micro-batches (each within capacity) dealt to ranks, unbalanced on purpose.
    order = list(range(len(lengths)))
    rng.shuffle(order)
    bins, current = [], [[], 0, 0]
    for i in order:
        if current[1] + lengths[i] > capacity or rng.random() < 0.25:
            bins.append(current)
            current = [[], 0, 0]
        current[0].append(i)
        current[1] += lengths[i]
    bins.append(current)
    ref = [[] for _ in range(ranks_n)]
    for k, b in enumerate(bins):
        ref[min(k % ranks_n + (k % 3 == 0), ranks_n - 1)].append(b)
    rebalances_as_the_reference_does(ref, lengths, capacity)


@pytest.mark.parametrize("seed", range(24))
def test_rebalance_over_many_samples_a_rank_picks_swaps_as_the_reference_does(seed):
    """Ranks of 50-150 samples each, of a few lengths, so that many swaps tie at the best
    gain, through both of its deltas (an odd gap is narrowed as much by (gap - 1) / 2 as by
    (gap + 1) / 2): the swap searched for (`_best_swap`), not tried pair by pair, must pick
    the reference's first best pair, source order then destination order."""
    rng = random.Random(3000 + seed)
    capacity = rng.choice([48, 64, 96])
    run = rng.randint(1, 20)  # three lengths in a row: a source length with both deltas at hand
    values = sorted({run, run + 1, run + 2, *rng.sample(range(1, 25), rng.randint(1, 3))})
    ranks_n = rng.choice([2, 3, 4])
    lengths = [rng.choice(values) for _ in range(ranks_n * rng.randint(50, 150))]
    ref: list[list[list]] = [[] for _ in range(ranks_n)]
    current, home = [[], 0, 0], 0
    for i, length in enumerate(lengths):
        if current[1] + length > capacity - rng.randint(0, 8):
            ref[home].append(current)
            current, home = [[], 0, 0], rng.choice([0, 0, *range(ranks_n)])  # rank 0 the heaviest
        current[0].append(i)
        current[1] += length
    ref[home].append(current)
    rebalances_as_the_reference_does(ref, lengths, capacity)


@pytest.mark.parametrize("seed", range(20))
def test_karmarkar_karp_assigns_as_the_reference_does(seed):
    rng = random.Random(2000 + seed)
    ranks = rng.choice([2, 3, 4, 8])
    tokens = [rng.choice([0, 1, 5, 9, 16, rng.randint(0, 64)]) for _ in range(ranks * rng.randint(1, 7))]
    bins = [mb([k], t) for k, t in enumerate(tokens)]
    got = karmarkar_karp(bins, ranks)
    want = Reference.karmarkar_karp([[[k], t, 0] for k, t in enumerate(tokens)], ranks)
    assert [[b.samples for b in rank] for rank in got] == [[b[0] for b in rank] for rank in want]


def test_plan_from_wire_reads_tokens_padding_and_samples():
    # Written out by hand: per micro-batch [tokens, padding, *samples].
    wire = [[[7, 1, 0, 2]], [[5, 3, 1], [0, 8]]]
    plan = PackPlan.from_wire(wire)
    assert placement(plan.ranks) == [[([0, 2], 7, 1)], [([1], 5, 3), ([], 0, 8)]]
    assert plan.rank_tokens() == [8, 16]
    assert plan.to_wire() == wire
