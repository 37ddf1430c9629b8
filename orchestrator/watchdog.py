"""The stall watchdog: re-runs a step in flight that makes no progress, and says why.

A task message can be lost outright (a Redis that dies between handing a message to a
worker and the worker receiving it), and the stages are idempotent: enqueueing a stuck
step's first task again skips what is done and redoes only what is missing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import kombu.exceptions
import msgpack
import redis
import redis.asyncio as aioredis

from orchestrator.diagnosis import DIAGNOSE_SECONDS, RedisOutOfMemory, stall_reason
from orchestrator.errors import CannotShip
from orchestrator.publisher import Publisher
from orchestrator.settings import RunSettings
from orchestrator.waits import event_set_within
from tasks.ship import finalize
from tasks.stages.finalize import StepVerdict
from transport.connection import connect_redis
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys, StepValue

log = logging.getLogger("rlship.orchestrator")

STALL_CHECK_SECONDS = 1.0  # how often the stall watchdog looks at the steps in flight
STALL_BACKOFF_MAX_SECONDS = 600.0


@dataclass
class StepProgress:
    """What the stall watchdog last saw of a step in flight: its key and sent counts, since
    when they have not changed, and how often it has enqueued the step again."""

    marks: tuple[int, int]
    since: float
    requeued: int = 0
    diagnosed: float = 0.0


class StallWatchdog:
    def __init__(
        self,
        settings: RunSettings,
        client: aioredis.Redis,
        publisher: Publisher,
        stopping: asyncio.Event,
        in_flight: Callable[[], range],
        unsettled: Callable[[], int | None],
        on_fatal: Callable[[Exception], None],
    ) -> None:
        self.settings = settings
        self.client = client
        self.keys = RunKeys(settings.run_id)
        self.publisher = publisher
        self.stopping = stopping
        self.in_flight = in_flight  # the steps cut and not yet published
        self.unsettled = unsettled  # the newest cut whose verdict the dispatcher has not read
        self.on_fatal = on_fatal  # stops the run (a Redis out of memory, a run that cannot ship)
        self.stall_reason: str | None = None
        # Diagnosis makes blocking calls (INFO, CLIENT LIST): its own thread and client.
        self._diagnosis_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlship-diagnosis")
        self._sync_client = connect_redis(
            settings.redis_url, ride_out_outages=False, socket_timeout=5, socket_connect_timeout=5
        )

    async def watch(self) -> None:
        """Enqueue again the first task of a step that has made no progress for
        `stall_seconds`. Each further re-run of the same stuck step waits twice as long (up
        to `STALL_BACKOFF_MAX_SECONDS`): a step that stays stuck mostly waits on something a
        re-run cannot fix (a trainer that stopped reading), and every re-run adds one more
        send retrying for it; but a re-run must never stop, or a twice-lost message hangs the run."""
        progress: dict[int, StepProgress] = {}
        await self.client.unlink(self.keys.ship_fatal)  # an earlier start's: this one tries again
        while not self.stopping.is_set():
            await event_set_within(self.stopping, STALL_CHECK_SECONDS)
            steps = self.in_flight()
            pipe = self.client.pipeline(transaction=False)
            pipe.get(self.keys.ship_fatal)
            for step in steps:
                pipe.scard(self.keys.step_keys(step))
                pipe.scard(self.keys.sent(step))
            cannot_ship, *counts = await pipe.execute()
            if cannot_ship is not None:
                self.on_fatal(CannotShip(cannot_ship.decode()))
                return
            now = time.monotonic()
            for index, step in enumerate(steps):
                marks = (counts[2 * index], counts[2 * index + 1])
                seen = progress.get(step)
                if seen is None or seen.marks != marks:
                    progress[step] = StepProgress(marks, now)
                    continue
                if step == self.unsettled() and await self._found_empty(step):
                    continue  # not stuck: taken back at the next cut
                if now - max(seen.since, seen.diagnosed) >= DIAGNOSE_SECONDS:
                    seen.diagnosed = now
                    await self._diagnose(step, now - seen.since)
                if now - seen.since >= min(
                    self.settings.stall_seconds * 2**seen.requeued, STALL_BACKOFF_MAX_SECONDS
                ):
                    seen.requeued += 1
                    log.warning(
                        "step %d made no progress for %.0f s; enqueueing it again (time %d)",
                        step,
                        now - seen.since,
                        seen.requeued,
                    )
                    await self.publisher.enqueue_step(finalize, step)
                    seen.since = now
            for step in [s for s in progress if s not in steps]:
                del progress[step]
            if self.stall_reason and all(seen.diagnosed < seen.since for seen in progress.values()):
                self.stall_reason = None
                await self.client.hdel(self.keys.status, "stall_reason")

    async def _found_empty(self, step: int) -> bool:
        raw = await self.client.get(self.keys.step(step, StepValue.VERDICT))
        return raw is not None and StepVerdict.from_wire(msgpack.unpackb(raw, raw=False)).empty

    async def _diagnose(self, step: int, seconds: float) -> None:
        """Say why a step makes no progress (status `stall_reason` and the log); a Redis out
        of memory stops the run, since waiting cannot free it."""
        try:
            cause = await asyncio.get_running_loop().run_in_executor(
                self._diagnosis_thread, stall_reason, self._sync_client, self.settings
            )
        except (redis.RedisError, kombu.exceptions.OperationalError) as exc:
            # Asking during a Redis restart or failover: that is the cause, and no reason to stop.
            cause = f"Redis does not answer the diagnosis ({exc}): restarting or failing over?"
        if cause is None and seconds < self.settings.stall_seconds:
            return  # most likely a long stage still running: nothing to say yet
        reason = f"step {step} made no progress for {seconds:.0f} s: {cause or 'cause not found'}"
        if reason != self.stall_reason:
            log.warning("%s", reason)
        self.stall_reason = reason
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.status, "stall_reason", reason)
        pipe.expire(self.keys.status, DEFAULT_TTL_SECONDS)
        await pipe.execute()
        if "Redis is out of memory" in reason:
            self.on_fatal(RedisOutOfMemory(reason))

    def close(self) -> None:
        self._diagnosis_thread.shutdown(wait=True)
        self._sync_client.close()
