"""Bounded accounting: over a long run in which most groups are discarded, the run's Redis
memory and the orchestrator's memory stay flat (bounded by the pending batch), instead of growing
with the number of rollouts seen."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import tracemalloc

import numpy as np
import psutil
import pytest
import redis

from orchestrator.producer import AdmissionRefused, RolloutProducer
from orchestrator.settings import RunSettings
from tests.support.factories import group
from tests.support.shiprun import open_policy_gate, run_orchestrator, ship_settings
from transport.keys import WIRE_SUFFIX, RunKeys
from transport.store import PayloadStore

STEPS = 80


def produce_mostly_discarded(settings: RunSettings, stop) -> None:
    """Nine groups in ten have equal rewards (zero advantage): discarded on completion."""
    rng = np.random.default_rng(7)
    client = redis.Redis.from_url(settings.redis_url)
    producer = RolloutProducer.for_run(client, settings)
    index = 0
    while not stop.is_set():
        if producer.outstanding() + settings.group_size > settings.outstanding_limit:
            stop.wait(0.002)
            continue
        rewards = [1.0, 0.0, 1.0, 0.0] if rng.random() < 0.1 else [float(rng.integers(0, 2))] * 4
        policy = int(client.get(producer.keys.run_key("next_step")) or 0)  # on-policy: never stale
        with contextlib.suppress(AdmissionRefused):  # another turn of this loop waits
            tokens = int(rng.integers(20, 200))
            producer.produce(group(f"b{index}", rewards, num_output_tokens=tokens, policy_version=policy))
            index += 1


def run_bytes(client: redis.Redis, keys: RunKeys) -> int:
    """Memory of this run's own keys (not the whole server's, which other runs and tests
    share); the record stream grows with steps by design (a capped history), not with rollouts."""
    return sum(
        client.memory_usage(key, samples=0) or 0
        for key in client.scan_iter(match=f"{keys.prefix}*", count=1000)
        if key.decode() != keys.metrics_stream
    )


@pytest.mark.timeout(300)
def test_memory_stays_flat_while_most_groups_are_discarded(client, redis_url, run_id, workers, tmp_path):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, transport="fs", trainers="external", ranks=1, steps=STEPS,
        batch_size=8, group_size=4, samples_per_step=0, dedupe_horizon=256, max_outstanding_rollouts=64,
    )  # fmt: skip
    open_policy_gate(settings)  # no trainer reads the files, nor announces a policy
    store = PayloadStore(client, run_id)
    # arrived, rollout keys, their wire parts, redis bytes, traced, rss
    samples: list[tuple[int, int, int, int, int, int]] = []

    async def observe(orchestrator) -> None:
        seen = -1
        while True:
            if orchestrator.follower.records_published != seen:
                seen = orchestrator.follower.records_published
                # KEYS, one command, sees one instant; a SCAN's several calls would count a
                # key released after it was seen and one written after, both, as if held at once.
                found = client.keys(store.keys.rollout("*"))
                wires = sum(1 for k in found if k.endswith(WIRE_SUFFIX.encode()))
                keys = len(found) - wires
                redis_bytes = run_bytes(client, store.keys)
                samples.append((
                    orchestrator.ingest.accounting.arrived, keys, wires, redis_bytes,
                    tracemalloc.get_traced_memory()[0], psutil.Process().memory_info().rss,
                ))  # fmt: skip
            await asyncio.sleep(0.005)

    async def scenario() -> None:
        from tests.support import shiprun

        original = shiprun.Orchestrator

        class Observed(original):  # the real orchestrator, sampled after every record
            async def run(self):
                watcher = asyncio.create_task(observe(self))
                try:
                    return await super().run()
                finally:
                    watcher.cancel()

        shiprun.Orchestrator = Observed
        try:
            await run_orchestrator(settings, timeout=240)
        finally:
            shiprun.Orchestrator = original

    # The producer runs in its own process: only the orchestrator is measured here.
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    producer = context.Process(target=produce_mostly_discarded, args=(settings, stop))
    producer.start()
    tracemalloc.start()
    try:
        asyncio.run(scenario())
    finally:
        tracemalloc.stop()
        stop.set()
        producer.join(30)
        if producer.is_alive():
            producer.kill()
        store.delete_all_rollouts()

    arrived, keys, wires, redis_bytes, traced, rss = (np.array(c) for c in zip(*samples, strict=True))
    quarter = len(samples) // 4
    assert arrived[-1] > 3 * arrived[quarter] > 0, "most rollouts arrive after the first quarter"
    # Payloads held: what the producer may have outstanding, plus the cut steps: up to
    # max_async_level + 1 unpublished, the one just published and the one being released
    # (a release is awaited before the next is enqueued); not the thousands of rollouts seen.
    in_flight = (settings.max_async_level + 3) * settings.batch_size
    assert keys.max() <= settings.outstanding_limit + in_flight < arrived[-1] / 50
    # Wire parts only of trainable rollouts, made before the cut and let go at encode.
    assert wires.max() <= settings.outstanding_limit + in_flight
    # Flat after warm-up: growth over the last three quarters does not follow the rollouts seen.
    assert redis_bytes[quarter:].max() - redis_bytes[quarter] < 2 << 20
    assert traced[quarter:].max() - traced[quarter] < 1 << 20
    assert rss[quarter:].max() - rss[quarter] < 16 << 20
