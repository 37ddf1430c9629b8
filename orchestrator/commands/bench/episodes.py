"""`rlship bench episodes`: what taking verifiers episodes costs a producer (BENCHMARKS.md,
"Episodes in"): the CPU of writing a step's worth of synthetic episode groups through an
`EpisodeProducer` (conversion, checks, the Redis writes), against writing the very same
rollouts through a `RolloutProducer` from the record fields and Python lists an inference
server's client holds (their records and arrays made, checked, written). Both into throwaway
runs of the Redis at `--redis-url`, unadmitted; after a small warm-up round, the rounds'
medians are compared, and their sums (the CPU of every round pooled). Each side starts from
a collected heap (`one_round` says why). Needs the verifiers extra.

    rlship bench episodes --branches 4096 --seq-len 4700 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.records import RolloutRecord
from orchestrator.settings import RunSettings
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.store import PayloadStore


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--branches", type=int, default=4096, help="trainable branches a round (a step)")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=4700,
        help="the synthetic run's seq_len (a branch averages about 1/9 of it)",
    )
    parser.add_argument("--group-size", type=int, default=8, help="episodes a group")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")


def one_round(client: Any, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """CPU seconds of the episodes written one way and their rollouts the other. Each side
    starts from a collected heap (`_settled`): the millions of objects the round's episodes
    and lists are made of push the interpreter towards a full collection, which fell inside
    whichever side ran next (the episodes side, from the third round on: 0.3-0.5 s of a
    0.8 s round), a cost of making the input, not of taking it. The collections each side
    sets off itself count, and are reported (`full_collections`)."""
    from orchestrator.producer import RolloutProducer
    from rlship.verifiers import EpisodeProducer
    from rlship.verifiers.synthetic import SyntheticEpisodes

    runs = [f"bench-episodes-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    settings = [
        RunSettings(run_id=run, redis_url=args.redis_url, group_size=args.group_size, seq_len=args.seq_len)
        for run in runs
    ]
    synthetic = SyntheticEpisodes(runs[0], seed, args.group_size, seq_len=args.seq_len)
    groups = []
    branches = 0
    while branches < args.branches:  # made up front: the model's work, not the producer's
        groups.append(synthetic.group(0))
        branches += sum(trace.num_branches for e in groups[-1] for trace in e.traces if trace.agent.trainable)
    try:
        episodes = EpisodeProducer.for_run(client, settings[0], admitted=False)
        full_before = _settled()
        start = cpu_seconds()
        results = [episodes.produce(group) for group in groups]
        episodes_cpu = cpu_seconds() - start
        episodes_full = _full_collections() - full_before
        # The plain side writes the same rollouts, and the records of no tokens of the traces
        # that train nothing (rlship.verifiers.producers), from what a plain producer holds:
        # each record's fields (as a plain rollout has them: of no episode) and the lists an
        # inference server gives; it builds its records and arrays, as the episodes side does.
        written = [result.written for result in results]
        as_lists = [
            [(_plain_fields(record), {k: v.tolist() for k, v in a.items()}) for record, a in g]
            for g in written
        ]
        rollouts = RolloutProducer.for_run(client, settings[1], admitted=False)
        full_before = _settled()
        start = cpu_seconds()
        for group in as_lists:
            rollouts.produce([(RolloutRecord(**fields), _arrays(lists)) for fields, lists in group])
        rollouts_cpu = cpu_seconds() - start
        rollouts_full = _full_collections() - full_before
    finally:
        for run in runs:
            PayloadStore(client, run).delete_all_rollouts()
            keys = list(client.scan_iter(match=RunKeys(run).prefix + "*", count=1000))
            if keys:
                client.unlink(*keys)
    tokens = sum(len(a["input_ids"]) for group in written for _, a in group)
    return {
        "episodes_cpu": episodes_cpu,
        "rollouts_cpu": rollouts_cpu,
        "full_collections": {"episodes": episodes_full, "rollouts": rollouts_full},
        "rollouts": sum(len(result.rollouts) for result in results),
        "untrained": sum(len(result.untrained) for result in results),
        "tokens": tokens,
    }


def _settled() -> int:
    """Collect the heap now (its debt is the input's making), and return the full collections
    so far."""
    gc.collect()
    return _full_collections()


def _full_collections() -> int:
    return gc.get_stats()[2]["collections"]


def _plain_fields(record: RolloutRecord) -> dict[str, Any]:
    """A rollout's record fields as a plain producer has them: no episode, no trace."""
    return record.model_dump(exclude_unset=True, exclude={"episode_id", "trace"})


def _arrays(lists: dict[str, list]) -> dict[str, np.ndarray]:
    """A plain rollout's arrays from the lists an inference server gives."""
    dtypes = {"input_ids": np.int64, "loss_mask": bool, "mm_token_type_ids": np.int64}
    return {name: np.asarray(values, dtype=dtypes.get(name, np.float32)) for name, values in lists.items()}


def main(args: argparse.Namespace) -> int:
    client = connect_redis(args.redis_url)
    warm_up = argparse.Namespace(**{**vars(args), "branches": 64})
    one_round(client, warm_up, seed=args.rounds)  # imports, scripts: not counted
    rounds = [one_round(client, args, seed) for seed in range(args.rounds)]
    episodes = statistics.median(r["episodes_cpu"] for r in rounds)
    plain = statistics.median(r["rollouts_cpu"] for r in rounds)
    first = rounds[0]
    print(
        f"a round: {first['rollouts']:,} rollouts (trainable branches), {first['tokens']:,} tokens, "
        f"{first['untrained']:,} records of traces that train nothing"
    )
    for name, label, median in (
        ("episodes_cpu", "episodes", episodes),
        ("rollouts_cpu", "plain rollouts", plain),
    ):
        each = ", ".join(f"{r[name]:.2f}" for r in rounds)
        print(f"{label}: {median:.2f} s CPU (rounds {each})")
    full = {side: sum(r["full_collections"][side] for r in rounds) for side in ("episodes", "rollouts")}
    print(f"full collections inside the timed parts: episodes {full['episodes']}, plain {full['rollouts']}")
    pooled = sum(r["episodes_cpu"] for r in rounds) / sum(r["rollouts_cpu"] for r in rounds)
    print(f"episodes / plain: {episodes / plain:.2f}x (medians), {pooled:.2f}x (every round's CPU pooled)")
    if args.json is not None:
        summary = {"rounds": rounds, "ratio": episodes / plain, "pooled_ratio": pooled}
        args.json.write_text(json.dumps(summary, indent=1))
    return 0
