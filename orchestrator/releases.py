"""Release bookkeeping: each shipped step's release task, and what is left at the end.

A shipped step's per-rank payloads and rollouts (and their files of side-array rows) are
released by its `release` task. At
most one release is pending: the next waits for it, and its message is enqueued again if
it is not done after `stall_seconds` (a Redis that dies can lose it; release is
idempotent). At the end of the run the retained payloads and every rollout still held go,
with the run's directory of rows files.

A rank may acknowledge a step only after the step's release task ran (a MoE rank by handle
reads its rows files first): its payloads would then wait in Redis for the next step's
release, two steps' payloads held at once. Where ranks acknowledge to Redis, the
orchestrator follows each released step until every rank has acknowledged it and releases
its payloads then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from orchestrator.gate import POLL_SECONDS
from orchestrator.policy import PolicyVersion
from orchestrator.publisher import Publisher
from orchestrator.settings import RunSettings
from orchestrator.waits import event_set_within
from tasks.ship import release
from transport.numbering import version_after
from transport.store import AsyncPayloadStore

log = logging.getLogger("rlship.orchestrator")

FOLLOW_SECONDS = 0.05  # how often a released step's acknowledgements are looked at


class Releases:
    def __init__(
        self,
        settings: RunSettings,
        client: aioredis.Redis,
        store: AsyncPayloadStore,
        publisher: Publisher,
        stopping: asyncio.Event,
        on_released: Callable[[int], Awaitable[None]],
    ) -> None:
        self.settings = settings
        self.client = client
        self.store = store
        self.keys = store.keys
        self.publisher = publisher
        self.stopping = stopping
        self.on_released = on_released  # a step's release task is done
        self.pending: asyncio.Task[None] | None = None
        # Ranks that acknowledge to Redis: a released step is followed until they all have.
        self.acknowledged = settings.policy_source in ("redis", "both")
        self.following: asyncio.Task[None] | None = None
        self._superseded = asyncio.Event()
        # The run's files that go with its steps: rows files, and retained payloads if in files.
        self.rows = settings.run_rows()
        self.directory = settings.payload_directory()

    async def schedule(self, step: int) -> None:
        """At most one release pending: wait for the previous one, then enqueue this one."""
        await self.drain()
        await self._enqueue_release(step)
        self.pending = asyncio.create_task(self._await_released(step))

    async def _enqueue_release(self, step: int) -> None:
        await self.publisher.enqueue_step(release, step, self.settings.ranks, self.settings.replay_steps)

    async def _await_released(self, step: int) -> None:
        """Until the step is released; its task is enqueued again after `stall_seconds`
        (the message can be lost with a Redis that dies, and release is idempotent)."""
        loop = asyncio.get_running_loop()
        resend_at = loop.time() + self.settings.stall_seconds
        while not await self.client.hexists(self.keys.released, step):
            if self.stopping.is_set():
                return
            if loop.time() >= resend_at:
                log.warning(
                    "step %d not released after %.0f s; enqueueing it again",
                    step,
                    self.settings.stall_seconds,
                )
                await self._enqueue_release(step)
                resend_at = loop.time() + self.settings.stall_seconds
            await asyncio.sleep(POLL_SECONDS)
        await self.on_released(step)
        if self.acknowledged:
            self.following = asyncio.create_task(self._release_when_acknowledged(step))

    async def _release_when_acknowledged(self, step: int) -> None:
        """Release the retained payloads of steps <= `step` as each is acknowledged by every
        rank; until none is left, the run stops, or the next step's release takes over."""
        while not self.stopping.is_set() and not self._superseded.is_set():
            waiting = [s for s in await self.store.unacknowledged_steps() if s <= step]
            if not waiting:
                return
            pipe = self.client.pipeline(transaction=False)
            for waited in waiting:
                pipe.scard(self.keys.trained(waited))
            if any(count >= self.settings.ranks for count in await pipe.execute()):
                await self.store.release_payloads(
                    self.settings.ranks, step, evict_through=-1, rows=self.rows, directory=self.directory
                )
                continue
            await event_set_within(self._superseded, FOLLOW_SECONDS)

    async def drain(self) -> None:
        """Wait for the pending release, and end the follow of the step before it."""
        if self.pending is not None:
            await self.pending
            self.pending = None
        if self.following is not None:
            self._superseded.set()
            await self.following
            self.following = None
            self._superseded.clear()

    async def acknowledged_payloads(self, last_published: int, policy: PolicyVersion) -> list[int]:
        """At the end of the run, give the ranks `ack_timeout` seconds to acknowledge the
        last steps, then release every retained payload; return the steps never acknowledged.
        External trainers acknowledge nothing to Redis: their payloads go at once, unless
        they point at rows files, which a trainer reads when it trains the step: those go
        once the trainers' policy version says they trained the last step (or after
        `ack_timeout`, saying so)."""
        builtin = self.settings.trainers == "builtin"
        if not builtin and self.rows.exists():
            await self._trained_through(last_published, policy)
        deadline = time.monotonic() + (self.settings.ack_timeout if builtin else 0.0)
        while await self.store.unacknowledged_steps() and time.monotonic() < deadline:
            await self.store.release_payloads(
                self.settings.ranks,
                last_published,
                evict_through=-1,
                rows=self.rows,
                directory=self.directory,
            )
            await asyncio.sleep(POLL_SECONDS * 10)
        released = await self.store.release_payloads(
            self.settings.ranks,
            last_published,
            evict_through=last_published,
            rows=self.rows,
            directory=self.directory,
        )
        if released.evicted_unacknowledged and builtin:
            log.error(
                "steps %s were never acknowledged by every rank within %.0f s",
                released.evicted_unacknowledged,
                self.settings.ack_timeout,
            )
        return released.evicted_unacknowledged if builtin else []

    async def _trained_through(self, step: int, policy: PolicyVersion) -> None:
        trained = version_after(step, self.settings.first_step)
        deadline = time.monotonic() + self.settings.ack_timeout
        while await policy.update() < trained and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        if policy.version < trained:
            log.warning(
                "the trainers' policy version is %d after %.0f s (ack_timeout), not %d: the rows files "
                "of the last steps are deleted before they trained them",
                policy.version,
                self.settings.ack_timeout,
                trained,
            )

    async def unshipped(self) -> int:
        """At the end of the run every rollout still held (pending, in open groups, or not
        yet read from the stream) will never ship: release the payloads and the stream."""
        deleted = await self.store.delete_all_rollouts()
        await asyncio.to_thread(self.rows.remove_all)
        if self.directory is not None:
            await asyncio.to_thread(self.directory.remove_all)
        await self.client.unlink(self.keys.rollout_stream, self.keys.checkpoint)
        if deleted:
            log.info("released %d unshipped rollouts at shutdown", deleted)
        return deleted
