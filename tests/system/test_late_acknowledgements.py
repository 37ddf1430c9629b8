"""A step's payloads leave Redis once its last rank acknowledges, however late: not only at
the next step's release. Ranks that acknowledge after the step's release task ran (a MoE
step's by handle read their rows first) would otherwise hold two steps' payloads in Redis
at once (issue 36, item 4).

The real orchestrator, Celery workers and rlship's trainer ranks over ZMQ, each rank handing
a step on only once the step's release task has run. The test produces the next step's
rollouts only once the step's payloads are gone from Redis: if they wait for the next
step's release, they never go and the test fails naming the step."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from orchestrator.producer import RolloutProducer
from tests.support.factories import group
from tests.support.shiprun import run_orchestrator, ship_settings
from transport.base import ReceivedStep, StepReceiver
from transport.keys import RunKeys
from transport.store import PayloadStore
from transport.trainer import TrainerRank, open_receiver

pytestmark = pytest.mark.timeout(180)

STEPS, RANKS, GROUPS_PER_STEP = 3, 2, 2
GONE_WITHIN_SECONDS = 20.0


class AfterRelease:
    """A rank's receiver that hands a step on once the step's release task has run."""

    def __init__(self, inner: StepReceiver, client: redis.Redis, keys: RunKeys) -> None:
        self.inner, self.client, self.keys = inner, client, keys

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def foreign_dropped(self) -> int:
        return self.inner.foreign_dropped

    def receive(self, timeout: float | None = None) -> ReceivedStep | None:
        message = self.inner.receive(timeout)
        while message is not None and not self.client.hexists(self.keys.released, message.step):
            time.sleep(0.01)
        return message


def test_a_steps_payloads_go_when_its_last_rank_acknowledges_after_its_release(
    client, redis_url, run_id, workers, tmp_path
):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=STEPS, ranks=RANKS, batch_size=4 * GROUPS_PER_STEP,
        group_size=4, trainers="external", policy_source="redis", max_async_level=0,
        max_off_policy_steps=100, samples_per_step=0,
    )  # fmt: skip
    keys = RunKeys(run_id)
    producer = RolloutProducer(client, run_id)

    produced: list[int] = []

    def produce_step(step: int) -> None:
        for index in range(GROUPS_PER_STEP):
            producer.produce(group(f"s{step}g{index}", [1.0, 0.0, 1.0, 0.0]))
        produced.append(step)

    ranks = []
    for rank in range(RANKS):
        receiver = open_receiver(
            "zmq", rank, run_id=run_id, host=settings.zmq_host, port=settings.zmq_port,
            output_dir=tmp_path, next_step=settings.start_step,
        )  # fmt: skip
        late = AfterRelease(receiver, client, keys)
        trainer = TrainerRank(late, client, run_id, RANKS, settings.first_step)
        ranks.append((receiver, threading.Thread(target=trainer.run, kwargs={"steps": STEPS}, daemon=True)))
    outcome: dict[str, object] = {}
    orchestrator = threading.Thread(
        target=lambda: outcome.update(result=asyncio.run(run_orchestrator(settings))), daemon=True
    )
    try:
        for _, thread in ranks:
            thread.start()
        orchestrator.start()
        for step in settings.step_numbers:
            produce_step(step)
            payloads = [keys.payload(step, rank) for rank in range(RANKS)]
            deadline = time.monotonic() + GONE_WITHIN_SECONDS
            while not (client.hexists(keys.released, step) and client.exists(*payloads) == 0):
                assert time.monotonic() < deadline, (
                    f"step {step}'s payloads still in Redis {GONE_WITHIN_SECONDS:g} s after it was "
                    f"produced (released: {client.hexists(keys.released, step)}; acknowledged by "
                    f"{sorted(int(r) for r in client.smembers(keys.trained(step)))})"
                )
                time.sleep(0.01)
        orchestrator.join(60)
        assert "result" in outcome, "the orchestrator did not finish"
        assert outcome["result"].summary["steps_shipped"] == STEPS
    finally:
        for step in settings.step_numbers[len(produced) :]:  # a failed look: the run still ends
            produce_step(step)
        orchestrator.join(60)
        for receiver, thread in ranks:
            thread.join(10)
            receiver.close()
        PayloadStore(client, run_id).delete_all_rollouts()
