"""The packing stage's second implementation, the oracle of `tests/unit/test_pack_contract.py`:
plain Python written from `tasks.stages.pack`'s docstring (no numpy, nothing of the module
under test); a micro-batch is a [samples, tokens, padding] list."""

from __future__ import annotations


class Reference:
    ROUNDS = 256

    @staticmethod
    def ffd(lengths: list[int], capacity: int) -> list[list]:
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # longest first, stable
        bins: list[list] = []
        for i in order:
            home = next((b for b in bins if b[1] + lengths[i] <= capacity), None)
            if home is None:
                bins.append([[i], lengths[i], 0])
            else:
                home[0].append(i)
                home[1] += lengths[i]
        return bins

    @staticmethod
    def split(b: list, lengths: list[int]) -> list[list]:
        one, two = [[], 0, 0], [[], 0, 0]
        for i in sorted(b[0], key=lambda i: -lengths[i]):
            target = one if one[1] <= two[1] else two  # the lighter half; the first on a tie
            target[0].append(i)
            target[1] += lengths[i]
        return [one, two]

    @classmethod
    def split_to_multiple(cls, bins: list[list], lengths: list[int], ranks: int) -> list[list]:
        bins = list(bins)
        while len(bins) < ranks or len(bins) % ranks != 0:
            largest = None
            for b in bins:
                if len(b[0]) >= 2 and (largest is None or b[1] > largest[1]):
                    largest = b
            if largest is None:
                missing = ranks - len(bins) % ranks
                bins += [[[], 0, 0] for _ in range(missing)]
                break
            bins = [b for b in bins if b is not largest] + cls.split(largest, lengths)
        return bins

    @staticmethod
    def karmarkar_karp(bins: list[list], ranks: int) -> list[list[list]]:
        if not bins:
            return [[] for _ in range(ranks)]
        ordered = sorted(bins, key=lambda b: -(b[1] + b[2]))
        pool = []  # (spread, age, partition); a partition is a list of (sum, micro-batches)
        for age, start in enumerate(range(0, len(ordered), ranks)):
            part = sorted(([b[1] + b[2], [b]] for b in ordered[start : start + ranks]), key=lambda s: -s[0])
            pool.append((part[0][0] - part[-1][0], age, part))
        age = len(pool)
        while len(pool) > 1:
            pair = []
            for _ in range(2):  # the widest spread first, the oldest on a tie
                pick = min(pool, key=lambda p: (-p[0], p[1]))
                pool.remove(pick)
                pair.append(pick[2])
            first, second = pair
            assert len(first) == len(second)
            merged = [
                [first[k][0] + second[-1 - k][0], first[k][1] + second[-1 - k][1]] for k in range(len(first))
            ]
            merged.sort(key=lambda s: -s[0])
            pool.append((merged[0][0] - merged[-1][0], age, merged))
            age += 1
        return [items for _, items in pool[0][2]]

    @staticmethod
    def best(heavy: list[list], light: list[list], lengths: list[int], capacity: int, gap: int):
        """(gain, (src, i, dst, j or None)) of the move or swap that narrows the gap most."""
        src = [(b, i) for b in heavy if len(b[0]) >= 2 for i in b[0]]
        if not src:
            return None

        def gain(d: int) -> int:  # the gap goes from `gap` to |gap - 2d|
            return gap - abs(gap - 2 * d)

        best, best_gain = None, 0
        for s, i in src:
            for d in light:
                if lengths[i] <= capacity - d[1] and gain(lengths[i]) > best_gain:
                    best, best_gain = (s, i, d, None), gain(lengths[i])
        swap, swap_gain = None, 0
        for s, i in src:
            for d in light:
                for j in d[0]:
                    delta = lengths[i] - lengths[j]
                    if 0 < delta <= capacity - d[1] and gain(delta) > swap_gain:
                        swap, swap_gain = (s, i, d, j), gain(delta)
        if swap is not None and swap_gain > best_gain:
            return swap_gain, swap
        return None if best is None else (best_gain, best)

    @classmethod
    def rebalance(cls, ranks: list[list[list]], lengths: list[int], capacity: int) -> None:
        for _ in range(cls.ROUNDS):
            totals = [sum(b[1] for b in rank) for rank in ranks]
            heavy, light = totals.index(max(totals)), totals.index(min(totals))
            gap = totals[heavy] - totals[light]
            if gap < 2:
                return
            found = cls.best(ranks[heavy], ranks[light], lengths, capacity, gap)
            if found is None:
                return
            src, i, dst, j = found[1]
            src[0].remove(i)
            src[1] -= lengths[i]
            dst[0].append(i)
            dst[1] += lengths[i]
            if j is not None:
                dst[0].remove(j)
                dst[1] -= lengths[j]
                src[0].append(j)
                src[1] += lengths[j]

    @classmethod
    def pack(cls, lengths: list[int], ranks: int, seq_len: int, pad: int = 1) -> list[list[tuple]]:
        bins = cls.split_to_multiple(cls.ffd(lengths, seq_len), lengths, ranks)
        plan = cls.karmarkar_karp(bins, ranks)
        cls.rebalance(plan, lengths, seq_len)
        for rank in plan:
            for b in rank:
                b[2] = (pad - b[1] % pad) % pad if b[0] else pad
            rank.sort(key=lambda b: min(b[0]) if b[0] else len(lengths))
        return [[(b[0], b[1], b[2]) for b in rank] for rank in plan]
