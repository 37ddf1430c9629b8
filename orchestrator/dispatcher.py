"""Cut and dispatch: steps cut from the pending rollouts, and handed to the workers.

When enough trainable rollouts are pending and there is room in flight (`max_async_level`
steps past the last published), the dispatcher waits for the policy gate, takes a batch
from ingest, writes the step's manifest with ingest's checkpoint in one transaction and
enqueues the step's first task. It then reads each cut's verdict: a step the workers
emptied is taken back and cut again under the same number. Owns `next_step`, the
unsettled cut and the rollouts of each cut step until it ships.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgpack
import redis.asyncio as aioredis

from orchestrator.accounting import EMPTY_STEP
from orchestrator.checkpoint import Checkpoint
from orchestrator.errors import EmptySteps, RunStateLost
from orchestrator.gate import POLL_SECONDS, PolicyGate
from orchestrator.ingest import Ingest
from orchestrator.lag_probe import LagProbe
from orchestrator.publisher import Publisher
from orchestrator.rollout_log import RolloutLog
from orchestrator.settings import RunSettings
from tasks.manifest import StepManifest
from tasks.ship import finalize
from tasks.stages.finalize import StepVerdict
from transport.keys import StepValue
from transport.release_scripts import unlink_step_keys
from transport.replication import Durability
from transport.store import AsyncPayloadStore

log = logging.getLogger("rlship.orchestrator")


class Dispatcher:
    def __init__(
        self,
        settings: RunSettings,
        client: aioredis.Redis,
        store: AsyncPayloadStore,
        ingest: Ingest,
        gate: PolicyGate,
        publisher: Publisher,
        probe: LagProbe,
        rollout_log: RolloutLog,
        stopping: asyncio.Event,
        work: asyncio.Event,
        last_published: Callable[[], int],
        on_fatal: Callable[[Exception], None],
        loss_report: Callable[[], dict[str, Any]],
    ) -> None:
        # Given.
        self.settings = settings
        self.client = client
        self.store = store
        self.keys = store.keys
        self.config = settings.ship_config()
        self.durability = Durability.of(settings, self.keys.replication_probe)
        self.ingest = ingest
        self.gate = gate
        self.publisher = publisher
        self.probe = probe
        self.rollout_log = rollout_log
        self.stopping = stopping
        self.work = work  # set by ingest (rollouts enough) and by a published step (room)
        self.last_published = last_published
        self.on_fatal = on_fatal  # stops the run (`max_empty_steps` empty cuts in a row)
        self.loss_report = loss_report  # what a Redis that lost the run took with it
        # The run's steps are settings.step_numbers: from start_step (see transport.numbering).
        self.start_step: int = settings.step_numbers.start
        self.end_step: int = settings.step_numbers.stop
        # Moved on by each cut, back by each take-back; `resume` sets them from Redis.
        self.next_step = self.start_step
        # The newest cut step whose verdict (tasks.stages.finalize.StepVerdict) is not read yet.
        self.unsettled: int | None = None
        self.cut_rollouts: dict[int, list[str]] = {}  # until shipped, for the rollout log
        # The policy wait of a cut taken back, which the next cut of its number reports.
        self.taken_back_wait = 0.0

    async def resume(self) -> None:
        """Continue after the last cut of a previous orchestrator of the run."""
        self.next_step = int(await self.client.get(self.keys.next_step) or self.start_step)

    async def enqueue_unpublished(self) -> list[int]:
        """Enqueue again the first task of each cut step not yet published (the stages are
        idempotent); the newest may have no verdict yet. Return those steps."""
        unpublished = [
            step
            for step in range(self.last_published() + 1, self.next_step)
            if not await self.client.hexists(self.keys.published, step)
        ]
        await self.publisher.traces.resume(self.client, unpublished)
        for step in unpublished:
            await self.publisher.enqueue_step(finalize, step)
        if unpublished:
            self.unsettled = self.next_step - 1  # only the newest cut can be without its verdict
        return unpublished

    async def log_shipped(self, step: int) -> None:
        """Tell the rollout log which of the step's rollouts shipped (read before release)."""
        rollout_ids = self.cut_rollouts.pop(step, [])
        if self.rollout_log.enabled:
            raw_dropped = await self.client.get(self.keys.step(step, StepValue.DROPPED))
            dropped = msgpack.unpackb(raw_dropped or b"\x80")
            self.rollout_log.shipped(step, rollout_ids, dropped)

    async def run(self) -> None:
        """Cut steps while there are steps to ship, enough pending rollouts, and room in flight.

        Before cutting the next step, the previous cut's verdict is read (written by its
        finalize task; it is usually there by the time enough rollouts for another step
        are): a step the workers emptied is cut again under the same number."""
        while not self.stopping.is_set():
            last_cut = self.next_step >= self.end_step
            enough = len(self.ingest.pending) >= self.settings.batch_size
            # Read once there are rollouts for another cut (it is usually there by then), even
            # with the steps in flight at their limit: an empty step would hold it forever.
            if self.unsettled is not None and (enough or last_cut):
                await self.settle(self.unsettled)
                continue
            if last_cut:
                return
            in_flight = self.next_step - 1 - self.last_published()
            if not enough or in_flight > self.settings.max_async_level:
                self.work.clear()
                await self.work.wait()
                continue
            step = self.next_step
            waited = await self.gate.wait(step)
            if not self.stopping.is_set() and await self.cut(step, waited) is not None:
                self.next_step = step + 1
                self.unsettled = step

    async def settle(self, step: int) -> None:
        """Wait for step `step`'s verdict; if the workers dropped every one of its rollouts,
        take the cut back (`_take_back`) and stop the run after `max_empty_steps` in a row."""
        verdict: StepVerdict | None = None
        # A step already published shipped something; its release may have deleted the verdict.
        while verdict is None and step > self.last_published():
            if self.stopping.is_set():
                return
            raw = await self.client.get(self.keys.step(step, StepValue.VERDICT))
            if raw is None:
                await asyncio.sleep(POLL_SECONDS)
            else:
                verdict = StepVerdict.from_wire(msgpack.unpackb(raw, raw=False))
        self.unsettled = None
        if verdict is None or not verdict.empty:
            self.ingest.kept()
            return
        in_a_row = await self._take_back(step, verdict.dropped)
        reasons = ", ".join(f"{field} {count}" for field, count in sorted(verdict.dropped.items()))
        log.warning(
            "step %d: the workers dropped all %d of its rollouts (%s); cutting step %d again "
            "(%d empty in a row, the run stops at %d)",
            step,
            sum(verdict.dropped.values()),
            reasons,
            step,
            in_a_row,
            self.settings.max_empty_steps,
        )
        if in_a_row >= self.settings.max_empty_steps:
            self.on_fatal(
                EmptySteps(
                    f"{in_a_row} consecutive steps had every rollout dropped by the workers (last: step "
                    f"{step}, {sum(verdict.dropped.values())} dropped, reason {reasons}); see the workers' "
                    "logs ('rollout ... dropped: ...') and the producers' payloads"
                )
            )

    async def cut(self, step: int, policy_wait: float = 0.0) -> StepManifest | None:
        """Write step `step`'s manifest and enqueue its first task; None if nothing trainable.
        `policy_wait`: the seconds the gate held this step, for its record."""
        ingest = self.ingest
        stale_ids = ingest.drop_stale(step)
        if stale_ids:
            self.rollout_log.dropped_at_cut(stale_ids, step, "stale")
            await self.store.delete_rollouts(stale_ids)
            await ingest.write_outcomes(self.client)
            rows = self.settings.run_rows()
            if rows.exists():
                await asyncio.to_thread(rows.unlink, stale_ids)
        if not len(ingest.pending):
            return None
        async with ingest.cutting():
            batch = ingest.take(self.settings.batch_size)
            batch_ids = batch.labels["rollout_id"]
            self.rollout_log.cut(step)
            self.cut_rollouts[step] = batch_ids
            manifest = StepManifest(
                run_id=self.settings.run_id,
                step=step,
                prev_step=step - 1 if step > self.start_step else -1,  # -1: no step before it
                cut_time=time.time(),
                config=self.config,
                effective=batch,
                window=ingest.take_window(),
                counters=ingest.accounting.snapshot(len(ingest.pending), len(ingest.groups)),
                loop_lag_ms=self.probe.take_window(),
                policy_wait=policy_wait + self.taken_back_wait,
            )
            self.taken_back_wait = 0.0
            traceparent = self.publisher.traces.open(manifest, self.gate.policy.version)
            write = functools.partial(
                self._write_cut,
                manifest,
                traceparent,
                batch_ids,
                ingest.checkpoint(),
                ingest.accounting.accounted,
                ingest.oldest_held(),
            )
            await self.publisher.call(write)
        await self.publisher.enqueue_step(finalize, step)
        return manifest

    def _write_cut(
        self,
        manifest: StepManifest,
        traceparent: str | None,
        batch_ids: list[str],
        checkpoint: Checkpoint,
        accounted: int,
        oldest_held: str,
    ) -> None:
        """The cut's one transaction, on the publisher thread: at 16k rollouts packing the
        manifest and one SADD argument per rollout key take 50 ms, one pause on the loop;
        here the loop gets the GIL back between the pieces (`packb_in_pieces`). With the
        step's `traceparent` (tracing on, the step sampled), its trace key too."""
        step = manifest.step
        manifest_key = self.keys.step(step, StepValue.MANIFEST)
        client = self.publisher.client

        def write() -> None:
            pipe = client.pipeline(transaction=True)
            pipe.set(manifest_key, manifest.to_bytes(), ex=self.store.ttl)
            pipe.sadd(self.keys.step_keys(step), manifest_key, *(self.keys.rollout(r) for r in batch_ids))
            pipe.expire(self.keys.step_keys(step), self.store.ttl)
            pipe.set(self.keys.next_step, step + 1, ex=self.store.ttl)
            pipe.set(self.keys.checkpoint, checkpoint.to_bytes(), ex=self.store.ttl)
            pipe.set(self.keys.accounted, accounted, ex=self.store.ttl)
            pipe.xtrim(self.keys.rollout_stream, minid=oldest_held)
            if traceparent is not None:
                pipe.set(self.keys.trace(step), traceparent, ex=self.store.ttl)
            pipe.execute()

        # Its tasks are enqueued only once a replica holds the cut: a cut lost in a failover
        # would leave them a step with no manifest (`transport.replication`).
        self.durability.replicate(client, write, lambda pipe: pipe.exists(manifest_key), f"step {step}'s cut")

    async def _take_back(self, step: int, dropped: dict[str, int]) -> int:
        """Undo the cut of an empty step: its rollouts are discarded (`empty_step`), its keys
        deleted, its window of `all` statistics, event-loop lag and policy wait go to the
        next cut, and the step number is cut again; its drops by field are counted in the
        run's record (`empty_step/dropped/{field}`). The manifest is read back from Redis, so a restarted
        orchestrator takes back a cut of its predecessor the same way. Returns the empty
        cuts in a row, this one included."""
        manifest = StepManifest.from_bytes(await self._read_manifest(step))
        in_a_row = self.ingest.put_back(manifest, dropped)
        self.publisher.traces.end(step, "every rollout dropped: the cut is taken back")
        self.probe.put_back(manifest.loop_lag_ms)
        self.taken_back_wait += manifest.policy_wait
        # The rollout log knows the rollouts this process cut (not a predecessor's).
        self.rollout_log.dropped_at_cut(self.cut_rollouts.pop(step, []), step, EMPTY_STEP)
        self.next_step = step
        pipe = self.client.pipeline(transaction=True)
        await unlink_step_keys(pipe, self.keys, step)
        pipe.set(self.keys.next_step, step, ex=self.store.ttl)
        pipe.set(self.keys.checkpoint, self.ingest.checkpoint().to_bytes(), ex=self.store.ttl)
        await pipe.execute()
        return in_a_row

    async def _read_manifest(self, step: int) -> bytes:
        raw = await self.client.get(self.keys.step(step, StepValue.MANIFEST))
        if raw is None:
            raise RunStateLost(self.settings.run_id, self.loss_report())
        return raw
