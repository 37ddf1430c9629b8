"""The orchestrator: an asyncio process that never touches payload bytes.

The `Orchestrator` builds the components, wires them, resumes the run and starts and
stops their concurrent loops; it has no loop of its own. The loops, each a component in
its own module, and what each owns:

- **ingest** (`Ingest`, orchestrator.ingest): reads rollout records from the Redis stream,
  completes groups, decides each rollout's fate, releases at once what cannot train and
  hands what can to the workers to prepare for the wire before the cut (`tasks.ship.prepare`).
  Owns the stream cursor, the open groups, the pending rollouts, the window of `all`
  statistics and the accounting.
- **cut and dispatch** (`Dispatcher`, orchestrator.dispatcher): when enough rollouts are
  pending and there is room in flight, waits for the policy gate (`PolicyGate`,
  orchestrator.gate), writes the step's manifest, enqueues its first task, reads the
  cut's verdict and takes back a step the workers emptied. Owns `next_step`.
- **follow records** (`RecordFollower`, orchestrator.follower): mirrors each published
  record to the monitors and the terminal and hands its step on, to be released by
  `Releases` (orchestrator.releases, at most one release pending). Owns `last_published`.
- **stall watchdog** (`StallWatchdog`, orchestrator.watchdog): enqueues again a step in
  flight that makes no progress, and says why it is stuck.
- **rank watch** (`RankWatch`, orchestrator.rank_watch): stops the run when a trainer rank
  it waits on has been silent for `rank_timeout`, naming it.
- **lease** (`Lease`, orchestrator.lease): holds the run's orchestrator lease, alive
  mark and claim of its ZMQ port pair; stops the run if Redis lost the run, another
  orchestrator took the lease or another run holds the ports.
- **lag probe** (`LagProbe`, orchestrator.lag_probe): the event loop's own lag, every 10 ms.
- and the policy source (`PolicyVersion.follow`, orchestrator.policy) keeps the trainers'
  policy version current for the gate.

Components do not reference the orchestrator: each gets the settings, the Redis client,
the `stopping` event, the components it calls (typed constructor arguments) and, where it
must reach further, a hook or a provider (`on_fatal`, `on_published`, `next_step`,
`last_published`). Blocking broker and Redis calls run on one `Publisher` thread
(Celery's `apply_async` is synchronous); completions are learned from Redis through
`redis.asyncio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from orchestrator.checkpoint import Checkpoint
from orchestrator.dispatcher import Dispatcher
from orchestrator.errors import EmptySteps, RunStateLost
from orchestrator.exporter import serve_metrics
from orchestrator.follower import RecordFollower
from orchestrator.gate import PolicyGate
from orchestrator.ingest import Ingest
from orchestrator.lag_probe import LagProbe
from orchestrator.lease import Lease
from orchestrator.policy import PolicyVersion
from orchestrator.publisher import Publisher
from orchestrator.rank_watch import RankWatch
from orchestrator.releases import Releases
from orchestrator.resume import resumed, stored_form
from orchestrator.rollout_log import RolloutLog
from orchestrator.run_info import RunInfo
from orchestrator.settings import RunSettings
from orchestrator.span_relay import SpanRelay
from orchestrator.step_metrics import StepMetrics, take_step_seconds
from orchestrator.watchdog import StallWatchdog
from tasks.app import use_redis
from tasks.ship import prepare
from transport.keys import DEFAULT_TTL_SECONDS
from transport.numbering import version_after
from transport.store import AsyncPayloadStore

log = logging.getLogger("rlship.orchestrator")


class Orchestrator:
    def __init__(self, settings: RunSettings, client: aioredis.Redis, probe: LagProbe | None = None) -> None:
        # The tasks it enqueues go to the Redis its keys are on, whatever REDIS_URL the
        # Celery app was built from (a `--redis-url` flag or a `--config` file).
        use_redis(settings.redis_url)
        # Given, and derived from the settings.
        self.settings = settings
        self.client = client
        self.store = AsyncPayloadStore(client, settings.run_id)
        self.keys = self.store.keys
        # The run's steps are settings.step_numbers: from start_step (see transport.numbering).
        self.start_step: int = settings.step_numbers.start
        self.end_step: int = settings.step_numbers.stop
        # Loop control. Loops stop at their next turn: cancelling a blocking redis.asyncio
        # read (XREAD BLOCK) can hang the cancellation (redis-py #2028, #2579).
        self._stopping = asyncio.Event()
        self._work = asyncio.Event()  # pending rollouts or room in flight: cut again?
        self._aborted: Exception | None = None  # the error `run` raises once the loops stop
        # Components.
        self.rollout_log = RolloutLog(settings.record_rollouts)
        self.probe = probe or LagProbe()  # the benchmark's keeps its timeline
        # The endpoint's histograms (served with `metrics_port`): each sample of the probe,
        # each released step's stage seconds (`step_released`).
        self.step_metrics = StepMetrics(settings.run_id)
        self.probe.on_sample = self.step_metrics.observe_lag
        self.publisher = Publisher(settings)
        self.policy = PolicyVersion(settings, client)
        self.gate = PolicyGate(settings, client, self.policy, self._stopping)
        self.ingest = Ingest(
            settings,
            client,
            self.rollout_log,
            self._stopping,
            self._work,
            next_step=lambda: self.dispatcher.next_step,
            status=self.status,
            prepare=self._prepare,
        )
        self.dispatcher = Dispatcher(
            settings,
            client,
            self.store,
            self.ingest,
            self.gate,
            self.publisher,
            self.probe,
            self.rollout_log,
            self._stopping,
            self._work,
            last_published=lambda: self.follower.last_published,
            on_fatal=self._abort,
            loss_report=self.loss_report,
        )
        self.releases = Releases(
            settings, client, self.store, self.publisher, self._stopping, on_released=self.step_released
        )
        self.follower = RecordFollower(settings, client, self._stopping, self.step_published)
        self.lease = Lease(
            client,
            settings.run_id,
            self._stopping,
            self._abort,
            self.loss_report,
            ports=(settings.zmq_host, settings.zmq_port) if settings.transport == "zmq" else None,
        )
        self.watchdog = StallWatchdog(
            settings,
            client,
            self.publisher,
            self._stopping,
            in_flight=lambda: range(self.follower.last_published + 1, self.dispatcher.next_step),
            unsettled=lambda: self.dispatcher.unsettled,
            on_fatal=self._abort,
        )
        self.rank_watch = RankWatch(
            settings,
            client,
            self.gate,
            self._stopping,
            in_flight=lambda: range(self.follower.last_published + 1, self.dispatcher.next_step),
            on_fatal=self._abort,
        )

    async def _prepare(self, rollout_ids: list[str]) -> None:
        """Have the workers prepare rollouts for the wire before the cut (`tasks.ship.prepare`)."""
        headers = self.publisher.traces.prepare_headers(rollout_ids)
        await self.publisher.enqueue(prepare, rollout_ids, headers=headers)

    def _abort(self, error: Exception) -> None:
        """Stop every loop at its next turn; `run` raises `error` once they have."""
        self._aborted = error
        self._stopping.set()
        self._work.set()

    def _abort_on_error(self, task: asyncio.Task[Any]) -> None:
        """A background loop that fails stops the run with its error instead of leaving the
        others waiting for it (a Redis that refuses a write would otherwise hang the run)."""
        if not task.cancelled() and task.exception() is not None and self._aborted is None:
            self._abort(task.exception())  # type: ignore[arg-type]

    def status(self) -> dict[str, float]:
        """What `rlship run`'s progress display shows (written each ingest turn)."""
        return {
            "arrived": self.ingest.accounting.arrived,
            "pending": len(self.ingest.pending),
            "in_open_groups": len(self.ingest.groups),
            "start_step": self.start_step,
            "next_step": self.dispatcher.next_step,
            "last_published": self.follower.last_published,
            "loop_lag_max_ms": round(self.probe.take_recent_max(), 3),
            "loop_lag_peak_ms": self.probe.max_ms,  # the run's worst, as its summary says (unrounded)
            "updated_at": time.time(),
        }

    async def step_published(self, step: int) -> None:
        """A step's record is published: tell the rollout log which of its rollouts shipped
        (read before the release deletes the step's keys), wake the dispatcher (there is
        room in flight) and release the step."""
        self.publisher.traces.published(step)
        await self.dispatcher.log_shipped(step)
        self._work.set()
        await self.releases.schedule(step)

    async def step_released(self, step: int) -> None:
        """A step is released: its tasks' seconds go into the endpoint's histograms, with the
        step's trace id as their exemplar when it is traced."""
        trace_id = self.publisher.traces.trace_id(step)
        seconds = await take_step_seconds(self.client, self.keys, step)
        self.step_metrics.observe_step(seconds, {"trace_id": trace_id} if trace_id else None)

    # -- the run's start and end -----------------------------------------------------

    def loss_report(self) -> dict[str, Any]:
        """What a Redis that came back empty took with it, as far as this process knows."""
        return {
            "steps_lost": list(range(self.follower.last_published + 1, self.dispatcher.next_step)),
            "rollouts_lost_pending": self.ingest.pending.rollout_ids,
            "rollouts_lost_in_open_groups": list(self.ingest.open_entries),
            "records_read": self.ingest.accounting.arrived,
        }

    async def resume(self) -> None:
        """Pick up the run where a previous orchestrator left it (orchestrator.checkpoint):
        its counters and held rollouts, and the cut steps not yet published (their first
        task is enqueued again; the stages are idempotent)."""
        await self.dispatcher.resume()
        await self.follower.resume()
        resumed_version = version_after(self.start_step - 1, self.settings.first_step)
        if resumed_version > 0:  # trainers resumed at start_step hold the steps before it
            await self.client.set(self.keys.policy_version, resumed_version, nx=True, ex=DEFAULT_TTL_SECONDS)
        raw = await self.client.get(self.keys.checkpoint)
        if raw is None:
            return
        checkpoint = Checkpoint.from_bytes(raw)
        self.ingest.resume(checkpoint)
        unpublished = await self.dispatcher.enqueue_unpublished()
        log.warning(
            "run %s resumed: next step %d, %d pending rollouts, %d in open groups to re-read; "
            "steps %s enqueued again",
            self.settings.run_id,
            self.dispatcher.next_step,
            len(self.ingest.pending),
            len(checkpoint.open_rollouts),
            unpublished,
        )

    async def run(self) -> dict[str, Any]:
        """Ship `settings.steps` steps (counting from where the run left off); return a summary.
        With tracing on over OTLP/HTTP, the workers' spans are relayed meanwhile, and what is
        left of them when it ends before it returns (`orchestrator.span_relay`)."""
        relay = SpanRelay.for_run(self.settings.redis_url, self.settings.run_id)
        if relay is not None:
            relay.start()
        try:
            return await self._ship()
        finally:
            if relay is not None:
                await asyncio.to_thread(relay.stop)

    async def _ship(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.follower.open()
        lease = asyncio.create_task(self.lease.hold())
        acquired = asyncio.create_task(self.lease.acquired.wait())
        await asyncio.wait({lease, acquired}, return_when=asyncio.FIRST_COMPLETED)
        if not self.lease.acquired.is_set():
            acquired.cancel()
            lease.result()  # the error that kept the lease from being taken (a Redis refusing writes)
            if self._aborted is not None:
                raise self._aborted  # refused: another run of this Redis holds the port pair
        stored = await self.client.get(self.keys.settings)
        if stored is not None:  # a resume may change only what the steps so far allow
            resumed(stored.decode(), self.settings, given=self.settings.model_fields_set)
        await self.client.set(self.keys.settings, stored_form(self.settings), ex=DEFAULT_TTL_SECONDS)
        await self.resume()
        info = RunInfo.from_settings(self.settings)
        await self.client.set(self.keys.info, info.model_dump_json(), ex=DEFAULT_TTL_SECONDS)
        info.write_beside_outputs()
        await self.policy.update()  # the first gate decision needs no wait for the follower
        # The imports' and setup's objects (tens of thousands of functions, tuples, dicts)
        # live as long as the process: frozen, a full garbage collection no longer walks them,
        # and its pauses on the loop shrink (at 16k rollouts a step they were 17-33 ms).
        gc.freeze()
        probe = asyncio.create_task(self.probe.run())
        loops = [
            lease,
            asyncio.create_task(self.policy.follow(self._stopping)),
            asyncio.create_task(self.ingest.run()),
            asyncio.create_task(self.dispatcher.run()),
            asyncio.create_task(self.watchdog.watch()),
            asyncio.create_task(self.rank_watch.watch()),
        ]
        for task in loops:
            task.add_done_callback(self._abort_on_error)
        metrics_server = None
        try:
            if self.settings.metrics_port:
                metrics_server = serve_metrics(self.settings, self.follower, self.probe, self.step_metrics)
            await self.follower.follow()
            await self.releases.drain()
        finally:
            self._stopping.set()
            self._work.set()
            probe.cancel()
            await asyncio.gather(probe, *loops, return_exceptions=True)
            with contextlib.suppress(redis.RedisError):  # the frame `rlship status` shows of the run's end
                pipe = self.client.pipeline(transaction=True)
                pipe.hset(self.keys.status, mapping=self.status())
                pipe.expire(self.keys.status, DEFAULT_TTL_SECONDS)
                await pipe.execute()
            self.publisher.traces.close()
            self.publisher.close()
            self.watchdog.close()
            self.follower.close()
            self.rollout_log.close()
            if metrics_server is not None:
                metrics_server.close()
        if isinstance(self._aborted, RunStateLost):
            path = Path(self.settings.output_dir) / "lost.json"
            path.write_text(json.dumps(self._aborted.report, indent=1))
            log.error("%s; the list is in %s", self._aborted, path)
        if isinstance(self._aborted, EmptySteps):
            await self.end_failed_run()
        if self._aborted is not None:
            raise self._aborted
        unacknowledged = await self.releases.acknowledged_payloads(self.follower.last_published, self.policy)
        await self.end_run()
        return {
            "steps_unacknowledged": unacknowledged,
            "steps_shipped": self.follower.records_published,
            "tokens_shipped": self.follower.tokens_shipped,
            "empty_steps": self.ingest.accounting.empty_steps,
            "orchestrator_seconds": time.perf_counter() - started,
            "loop_lag_max_ms": self.probe.max_ms,
        }

    async def end_run(self) -> None:
        """The run shipped every step: its tasks still queued are dropped (no alive mark), its
        id is marked used, and every key it leaves expires (`DEFAULT_TTL_SECONDS`). Marked
        finished first, which closes admission: a producer's write can no longer land after
        the rollouts still held, and their rows files, are released."""
        pipe = self.client.pipeline(transaction=True)
        pipe.unlink(self.keys.alive)
        pipe.set(self.keys.finished, time.time(), ex=DEFAULT_TTL_SECONDS)
        await pipe.execute()
        await self.releases.unshipped()
        await self.store.expire_run()

    async def end_failed_run(self) -> None:
        """The run cannot go on (resuming it would meet the same input): its queued tasks are
        dropped (no alive mark), its held rollouts released, and every key it leaves expires."""
        await self.client.unlink(self.keys.alive)
        await self.releases.unshipped()
        await self.store.expire_run()
