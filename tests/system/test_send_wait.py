"""A send waiting for its rank's previous step is one task that backs off, not one that
retries itself twenty times a second: Flower (and `celery events`) show it waiting.

A real ship worker takes a send whose rank has not had the previous step; the test holds
that previous step for a few seconds, counting the task's retries from the worker's own
Celery events, then lets it through."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter

import pytest
import redis

from tasks.app import app
from tasks.cohort import CohortBuilder
from tasks.manifest import ShipConfig, StepManifest
from tasks.send import RETRY_SECONDS, SEND_WAIT_MAX_SECONDS, send
from tests.support.processes import Workers, wait_for
from transport.keys import RunKeys

HOLD_SECONDS = 6.0
EVENT_BINDINGS = "_kombu.binding.celeryev"


class TaskEvents:
    """Celery events (the workers run with -E) of one task, counted by type, on a thread."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.counts: Counter[str] = Counter()
        self._receiver = None
        self._thread = threading.Thread(target=self._capture, daemon=True)
        self._ready = threading.Event()

    def _record(self, event: dict) -> None:
        if event.get("uuid") == self.task_id:
            self.counts[event["type"]] += 1

    def _capture(self) -> None:
        with app.connection() as connection:
            self._receiver = app.events.Receiver(connection, handlers={"*": self._record})
            self._ready.set()
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> TaskEvents:
        self._thread.start()
        self._ready.wait(10)
        time.sleep(0.5)  # the receiver's queue is bound once capture has started consuming
        return self

    def __exit__(self, *_: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)
        if self._receiver is not None:  # kombu keeps the receiver's binding: it is the test's
            with app.connection() as connection:
                client = connection.default_channel.client
                queue = self._receiver.queue.name.encode()
                bindings = [b for b in client.smembers(EVENT_BINDINGS) if b.endswith(queue)]
                if bindings:
                    client.srem(EVENT_BINDINGS, *bindings)


@pytest.mark.timeout(120)
def test_a_waiting_send_backs_off(workers: Workers, client: redis.Redis, run_id: str) -> None:
    keys = RunKeys(run_id)
    config = ShipConfig(ranks=1, seq_len=8, cpu_queue=workers.cpu_queue, ship_queue=workers.ship_queue)
    empty = CohortBuilder().build()
    manifest = StepManifest(run_id, step=1, prev_step=0, cut_time=time.time(), config=config,
                            effective=empty, window=empty)  # fmt: skip
    client.set(keys.alive, 1, ex=120)
    client.set(keys.step(1, "manifest"), manifest.to_bytes(), ex=600)
    task_id = f"send-wait-{run_id}"
    with TaskEvents(task_id) as events:
        send.apply_async((run_id, 1, 0), queue=workers.ship_queue, task_id=task_id)
        wait_for("the send to start waiting", lambda: events.counts["task-retried"])
        held_from = time.monotonic()
        time.sleep(HOLD_SECONDS)  # rank 0's step 0 is held: it has not left the ship worker
        # Let it through as a rank that acknowledged step 1 does: nothing is sent again.
        retries_while_held = events.counts["task-retried"]
        held = time.monotonic() - held_from
        client.set(keys.last_sent(0), 0, ex=600)
        client.hset(keys.received(0), 1, "acknowledged")
        wait_for("the send to finish", lambda: events.counts["task-succeeded"])
    assert client.sismember(keys.step(1, "sent"), 0)
    assert events.counts["task-received"] == events.counts["task-retried"] + 1
    # Retrying every RETRY_SECONDS would be ~HOLD_SECONDS / 0.05 = 120 retries; backing off
    # to SEND_WAIT_MAX_SECONDS, the doublings up to it and one a second after that.
    doublings = math.ceil(math.log2(SEND_WAIT_MAX_SECONDS / RETRY_SECONDS)) + 1
    bound = doublings + math.ceil(held / SEND_WAIT_MAX_SECONDS) + 1
    assert 1 <= retries_while_held <= bound, (retries_while_held, bound, dict(events.counts))
