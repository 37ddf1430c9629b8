"""Exactly-once, attacked: every stage task of a finished step is enqueued again, one copy
and several at once, before the step is released and after, while the run goes on and
after it ended. The oracles are outside the code's own marks: the messages a plain-socket
trainer counted, the records in the stream, and the workers' logs."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from celery.result import AsyncResult

from orchestrator.orchestrator import Orchestrator
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings
from tasks.ship import encode, finalize, metrics, publish, release, send
from tests.support.factories import group
from tests.support.shiprun import leftover_keys, open_policy_gate, ship_settings
from tests.support.wire_trainer import WireTrainer
from transport.keys import RunKeys
from transport.store import PayloadStore

pytestmark = pytest.mark.timeout(240)

STEPS, RANKS = 4, 2
ATTACKED = range(STEPS - 1)  # the last step's messages arrive after every duplicate would have
ALONE, CONCURRENT = 1, 4


def enqueue_again(settings: RunSettings, step: int, copies: int, with_release: bool) -> list[AsyncResult]:
    """Every stage task of `step` (prune and pack run in finalize's), `copies` times over,
    results kept to wait on."""
    run, cpu, ship = settings.run_id, settings.cpu_queue, settings.ship_queue
    calls: list[tuple[Any, tuple, str]] = [(task, (run, step), cpu) for task in (finalize, metrics, publish)]
    for rank in range(settings.ranks):
        calls += [(encode, (run, step, rank), cpu), (send, (run, step, rank), ship)]
    if with_release:
        calls.append((release, (run, step, settings.ranks, settings.replay_steps), cpu))
    return [
        task.apply_async(args, queue=queue, ignore_result=False)
        for _ in range(copies)
        for task, args, queue in calls
    ]


def wait_all(results: list[AsyncResult]) -> None:
    """Until every copy has run; a copy that raised fails the test here."""
    for result in results:
        result.get(timeout=60)
        result.forget()


class Attacker(Orchestrator):
    """The real orchestrator; when step N is recorded, and before anything else happens
    (the next step is not cut yet: max_async_level 0), step N's tasks are enqueued again
    (not released yet), then step N-1's (released by then)."""

    async def step_published(self, step: int) -> None:
        loop = asyncio.get_running_loop()
        if step in ATTACKED:
            copies = ALONE if step == 0 else CONCURRENT
            await loop.run_in_executor(None, attack, self.settings, step, copies, False)
        if step - 1 in ATTACKED:
            await self.releases.drain()
            assert await self.client.hexists(self.keys.released, step - 1)
            copies = ALONE if step - 1 == 0 else CONCURRENT
            await loop.run_in_executor(None, attack, self.settings, step - 1, copies, True)
        await super().step_published(step)  # the step's release is scheduled only now


def attack(settings: RunSettings, step: int, copies: int, with_release: bool) -> None:
    wait_all(enqueue_again(settings, step, copies, with_release))


def log_sizes(log_dir: Path) -> dict[Path, int]:
    return {path: path.stat().st_size for path in log_dir.glob("*.log")}


def log_since(sizes: dict[Path, int]) -> str:
    text = ""
    for path, size in sizes.items():
        with path.open("rb") as log:
            log.seek(size)
            text += log.read().decode(errors="replace")
    return text


async def run_attacked(settings: RunSettings) -> None:
    client = aioredis.Redis.from_url(settings.redis_url, socket_timeout=30)
    try:
        await asyncio.wait_for(Attacker(settings, client).run(), 180)
    finally:
        await client.aclose()


def test_stage_tasks_enqueued_again_for_a_done_step_change_nothing(
    client, redis_url, run_id, workers, tmp_path
):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=STEPS, ranks=RANKS, batch_size=8, group_size=4,
        trainers="external", max_async_level=0, max_off_policy_steps=100, samples_per_step=0,
        first_step=0,  # the steps below are numbered from 0
    )  # fmt: skip
    open_policy_gate(settings)  # the plain-socket trainer announces no policy
    producer = RolloutProducer(client, run_id)
    for index in range(STEPS * 2):
        producer.produce(group(f"x{index}", [1.0, 0.0, 1.0, 0.0]))
    sizes = log_sizes(workers.log_dir)  # workers log warnings and errors; only this test's part is read
    assert sizes, f"no worker logs in {workers.log_dir}"
    keys = RunKeys(run_id)

    with WireTrainer("127.0.0.1", settings.zmq_port, RANKS) as trainer:
        asyncio.run(run_attacked(settings))
        # The run is over and every step released: once more, all at once, every step.
        wait_all([r for step in range(STEPS) for r in enqueue_again(settings, step, CONCURRENT, True)])
        trainer.wait_for({(rank, step) for rank in range(RANKS) for step in range(STEPS)})
    PayloadStore(client, run_id).delete_all_rollouts()

    counts = trainer.counts()
    assert {(rank, step): counts[(rank, step)] for rank, step in counts} == {
        (rank, step): 1 for rank in range(RANKS) for step in range(STEPS)
    }, "each rank got each step exactly once"
    records = Counter(int(fields[b"step"]) for _, fields in client.xrange(keys.metrics_stream))
    assert records == dict.fromkeys(range(STEPS), 1), "one record per step"
    worker_log = log_since(sizes)
    assert "ERROR" not in worker_log and "Traceback" not in worker_log, worker_log[-3000:]
    # Each copy was recognised as redundant (its step done) or, once the run had ended, as a
    # task of an ended run, and counted (the run's own deliveries may add some).
    state = RunKeys(run_id)
    redundant = Counter({k.decode(): int(v) for k, v in client.hgetall(state.redundant).items()})
    redundant.update({k.decode(): int(v) for k, v in client.hgetall(state.tasks_dropped).items()})
    after_release = ALONE + (len(ATTACKED) - 1) * CONCURRENT + STEPS * CONCURRENT
    enqueued = ALONE + (len(ATTACKED) - 1) * CONCURRENT + after_release
    for stage in ("finalize", "metrics", "publish"):
        assert redundant.get(stage, 0) >= enqueued, (stage, redundant)
    for stage in ("encode", "send"):
        assert redundant.get(stage, 0) >= enqueued * RANKS, (stage, redundant)
    assert redundant.get("release", 0) >= after_release, redundant
    assert leftover_keys(client, run_id) == []
