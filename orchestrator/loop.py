"""The orchestrator: an asyncio loop that never touches payload bytes.

It reads rollout records from the Redis stream, completes groups, decides each rollout's
fate, releases what cannot train at once, cuts a step when enough trainable rollouts are
pending, waits for the policy gate, writes the step manifest and enqueues the step's
first task. A follower reads the published records, mirrors them to `metrics.jsonl`,
prints one line per step and schedules the release of each shipped step (at most one
pending). A probe measures the loop's own lag every 10 ms.

Celery's `apply_async` is synchronous, so it runs on one dedicated publisher thread;
completions are learned from Redis through `redis.asyncio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import socket
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import redis
import redis.asyncio as aioredis

from orchestrator.accounting import EMPTY_STEP, Accounting, outcome_row
from orchestrator.checkpoint import Checkpoint
from orchestrator.diagnosis import DIAGNOSE_SECONDS, RedisOutOfMemory, stall_reason
from orchestrator.groups import TRAINABLE, GroupBuffer, decide_group
from orchestrator.lag_probe import LagProbe
from orchestrator.monitors import Monitors
from orchestrator.policy import NO_VERSION, PolicyVersion
from orchestrator.records import IDENTIFIER, RecordRejected, parse_record
from orchestrator.rollout_log import RolloutLog
from orchestrator.run_info import RunInfo
from orchestrator.settings import RunSettings
from tasks.app import use_redis
from tasks.cohort import Cohort, CohortBuilder
from tasks.manifest import StepManifest
from tasks.ship import finalize, release
from tasks.stages.finalize import StepVerdict
from transport.connection import connect_redis
from transport.keys import StepValue
from transport.numbering import required_version, staleness, step_reaching, version_after
from transport.store import AsyncPayloadStore

log = logging.getLogger("rlship.orchestrator")

READ_BATCH = 128  # records handled per turn of the loop: a few ms, then other tasks run
READ_BLOCK_MS = 100
POLL_SECONDS = 0.01
RECENT_RECORDS = 8
LEASE_SECONDS = 5  # a killed orchestrator's successor waits at most this long to start
STALL_REPORT_SECONDS = 2.0  # a policy wait this long is reported, naming what it waits for
POLICY_REPORT_SECONDS = 5.0  # and again this often while it lasts
STALL_CHECK_SECONDS = 1.0  # how often the stall watchdog looks at the steps in flight
STALL_BACKOFF_MAX_SECONDS = 600.0
# The run-alive mark outlives its orchestrator by this much: a restarted one (which waits out
# the lease) finds its tasks still running; a run killed for good has its tasks dropped after.
ALIVE_SECONDS = 30


class RunStateLost(RuntimeError):
    """Redis no longer holds the run (it restarted without persistence, or was flushed)."""

    def __init__(self, run_id: str, report: dict[str, Any]) -> None:
        super().__init__(
            f"run {run_id}: Redis lost the run's state (restarted without persistence?): "
            f"steps {report['steps_lost']} were cut and not yet recorded, "
            f"{len(report['rollouts_lost_pending'])} pending rollouts and "
            f"{len(report['rollouts_lost_in_open_groups'])} in open groups are gone"
        )
        self.report = report


class EmptySteps(RuntimeError):
    """`max_empty_steps` cuts in a row had every rollout dropped by the workers: the run
    cannot make progress with what the producers send."""


class LeaseLost(RuntimeError):
    """Another orchestrator of the run took the lease: this one stops."""


@dataclass
class StepProgress:
    """What the stall watchdog last saw of a step in flight: its key and sent counts, since
    when they have not changed, and how often it has enqueued the step again."""

    marks: tuple[int, int]
    since: float
    requeued: int = 0
    diagnosed: float = 0.0


class Orchestrator:
    def __init__(self, settings: RunSettings, client: aioredis.Redis) -> None:
        # The tasks it enqueues go to the Redis its keys are on, whatever REDIS_URL the
        # Celery app was built from (a `--redis-url` flag or a `--config` file).
        use_redis(settings.redis_url)
        self.settings = settings
        self.client = client
        self.store = AsyncPayloadStore(client, settings.run_id)
        self.keys = self.store.keys
        self.config = settings.ship_config()
        self.policy = PolicyVersion(settings, client)
        self.groups = GroupBuffer(settings.group_size, memory=settings.dedupe_horizon)
        self.window = CohortBuilder()
        self.pending = CohortBuilder()  # trainable rows, in completion order, cut from the front
        self.accounting = Accounting()
        self.probe = LagProbe()
        # The run's steps are settings.step_numbers: from start_step (see transport.numbering).
        self.start_step: int = settings.step_numbers.start
        self.end_step: int = settings.step_numbers.stop
        self.next_step = self.start_step
        self.last_published = self.start_step - 1
        # The most recent records (the stream holds them all): bounded on a run of any length.
        self.records: deque[dict[str, float]] = deque(maxlen=RECENT_RECORDS)
        self.records_published = 0
        self.tokens_shipped = 0
        self._release_pending: asyncio.Task[None] | None = None
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlship-publisher")
        self._monitor_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlship-monitors")
        self._diagnosis_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlship-diagnosis")
        self._stall_reason: str | None = None
        self._work = asyncio.Event()
        # Background loops stop at their next turn: cancelling a blocking redis.asyncio
        # read (XREAD BLOCK) can hang the cancellation (redis-py #2028, #2579).
        self._stopping = asyncio.Event()
        self._stream_cursor = "0-0"
        self.rollout_log = RolloutLog(settings.record_rollouts)
        self._cut_rollouts: dict[int, list[str]] = {}
        # Stream entry of every rollout in an open group, oldest first (insertion order):
        # the stream is trimmed no further than the oldest, so a restart can re-read them.
        self._open_entries: dict[str, str] = {}
        self._resumed_from: Checkpoint | None = None
        # The newest cut step whose verdict (tasks.stages.finalize.StepVerdict) is not read yet.
        self._unsettled: int | None = None
        self._aborted: Exception | None = None

    @functools.cached_property
    def _sync_client(self) -> redis.Redis:
        """For the diagnosis thread only (blocking calls stay off the loop)."""
        return redis.Redis.from_url(self.settings.redis_url, socket_timeout=5, socket_connect_timeout=5)

    def _abort_on_error(self, task: asyncio.Task[Any]) -> None:
        """A background loop that fails stops the run with its error instead of leaving the
        others waiting for it (a Redis that refuses a write would otherwise hang the run)."""
        if not task.cancelled() and task.exception() is not None and self._aborted is None:
            self._abort(task.exception())  # type: ignore[arg-type]

    # -- ingestion ---------------------------------------------------------------------

    async def ingest(self) -> None:
        """Read rollout records until stopped; complete groups; release what cannot train."""
        while not self._stopping.is_set():
            response = await self.client.xread(
                {self.keys.rollout_stream: self._stream_cursor}, count=READ_BATCH, block=READ_BLOCK_MS
            )
            if not response:
                # No rollouts (the gate holds the producers, or they are done): the status
                # still says what was cut and published since, for `rlship status`.
                await self.client.hset(self.keys.status, mapping=self.status())
                continue
            entries = response[0][1]
            release_ids: list[str] = []
            for entry_id, fields in entries:
                release_ids.extend(self._take_record(entry_id.decode(), fields.get(b"record", b"")))
            self._stream_cursor = entries[-1][0].decode()
            pipe = self.client.pipeline(transaction=False)
            if release_ids:
                pipe.unlink(*(self.keys.rollout(r) for r in release_ids))
            pipe.set(self.keys.accounted, self.accounting.accounted)
            pipe.hset(self.keys.status, mapping=self.status())
            await pipe.execute()
            if len(self.pending) >= self.settings.batch_size:
                self._work.set()

    def _take_record(self, entry_id: str, raw: bytes) -> list[str]:
        """Account one stream record; return the rollout ids whose payloads to release.

        After a restart, a record the checkpoint covers is taken again only if its rollout
        was in an open group then (it was counted as arrived already)."""
        if self._resumed_from is not None and self._resumed_from.covers(entry_id):
            if _rollout_id_of(raw) not in self._resumed_from.open_rollouts:
                return []
        else:
            self.accounting.arrived += 1
        try:
            record = parse_record(raw)
            envs = self.settings.envs
            if envs is not None and record.env not in envs:
                raise RecordRejected(
                    "unknown_env", f"env: {record.env!r} is not one of the run's envs {envs}"
                )
            group = self.groups.add(record)
        except RecordRejected as exc:
            self.accounting.rejected[exc.reason] += 1
            log.warning("rollout record rejected (%s): %s", exc.reason, exc)
            rollout_id = _rollout_id_of(raw)
            return [rollout_id] if rollout_id and exc.reason != "duplicate_rollout" else []
        if group is None:
            self._open_entries[record.rollout_id] = entry_id
            return []
        for member in group:
            self._open_entries.pop(member.rollout_id, None)
        released = []
        for outcome in decide_group(
            group,
            self.next_step,
            self.settings.max_off_policy_steps,
            self.settings.normalize_advantages,
            self.settings.first_step,
        ):
            self.window.append(*outcome_row(outcome))
            self.rollout_log.finalized(outcome)
            if outcome.fate == TRAINABLE:
                self.pending.append(*outcome_row(outcome))
            else:
                self.accounting.discard(outcome.fate)
                released.append(outcome.record.rollout_id)
        return released

    def status(self) -> dict[str, float]:
        """What `rlship run`'s progress display shows (written each ingest turn)."""
        return {
            "arrived": self.accounting.arrived,
            "pending": len(self.pending),
            "in_open_groups": len(self.groups),
            "start_step": self.start_step,
            "next_step": self.next_step,
            "last_published": self.last_published,
            "loop_lag_max_ms": round(self.probe.take_recent_max(), 3),
            "updated_at": time.time(),
        }

    # -- cutting and dispatch ----------------------------------------------------------

    async def wait_for_policy(self, step: int) -> float:
        """Hold step `step` until the trainers' policy version (from the run's policy source)
        reaches `required_version`; add the time waited to the run's policy-wait total (the
        finalizer consumes it). While held, say every few seconds what it waits for."""
        needed = required_version(step, self.settings.first_step, self.settings.max_async_level)
        if self.policy.version >= needed:
            return 0.0
        started = time.perf_counter()
        next_report = started + STALL_REPORT_SECONDS
        reported = False
        while self.policy.version < needed:
            if self._stopping.is_set():
                return 0.0
            if time.perf_counter() >= next_report:
                await self._report_policy_wait(step, needed, time.perf_counter() - started)
                next_report = time.perf_counter() + POLICY_REPORT_SECONDS
                reported = True
            await self.policy.moved(min(1.0, max(POLL_SECONDS, next_report - time.perf_counter())))
        if reported:
            await self.client.hdel(self.keys.status, "stalled_ranks", "policy_gate")
            log.warning("step %d: the policy gate opened after %.1f s", step, time.perf_counter() - started)
        waited = time.perf_counter() - started
        await self.client.incrbyfloat(self.keys.policy_wait, waited)
        return waited

    async def _report_policy_wait(self, step: int, needed: int, seconds: float) -> None:
        """Name the source and version the gate waits for and, with rlship's trainers, the
        ranks that have not acknowledged the step that raises it (one stopped reading, or died)."""
        have = "none" if self.policy.version == NO_VERSION else self.policy.version
        held = (
            f"step {step} held by the policy gate: waiting for version {needed} from "
            f"{self.policy.describe()} (have {have}) for {seconds:.1f} s"
        )
        if self.settings.trainers == "builtin" and self.policy.source != "broadcasts":
            awaited_step = step_reaching(needed, self.settings.first_step)
            acknowledged = {int(r) for r in await self.client.smembers(self.keys.trained(awaited_step))}
            stalled = sorted(set(range(self.settings.ranks)) - acknowledged)
            await self.client.hset(self.keys.status, "stalled_ranks", json.dumps(stalled))
            held += f"; rank(s) {stalled} have not acknowledged step {awaited_step}"
        await self.client.hset(self.keys.status, "policy_gate", held)
        log.warning("%s", held)

    def _drop_stale_pending(self, step: int) -> list[str]:
        """Pending rollouts that went stale while waiting are discarded at the cut."""
        versions = self.pending.column("policy_version")
        stale = staleness(step, versions, self.settings.first_step) > self.settings.max_off_policy_steps
        if not stale.any():
            return []
        removed = self.pending.remove(stale)
        self.accounting.discard("stale", len(removed))
        return removed.labels["rollout_id"]

    async def cut(self, step: int) -> StepManifest | None:
        """Write step `step`'s manifest and enqueue its first task; None if nothing trainable."""
        stale_ids = self._drop_stale_pending(step)
        if stale_ids:
            self.rollout_log.dropped_at_cut(stale_ids, step, "stale")
            await self.store.delete_rollouts(stale_ids)
        if not len(self.pending):
            return None
        batch = self.pending.take(self.settings.batch_size)
        batch_ids = batch.labels["rollout_id"]
        self.accounting.cut += len(batch)
        self.rollout_log.cut(step)
        self._cut_rollouts[step] = batch_ids
        manifest = StepManifest(
            run_id=self.settings.run_id,
            step=step,
            prev_step=step - 1 if step > self.start_step else -1,  # -1: no step before it
            cut_time=time.time(),
            config=self.config,
            effective=batch,
            window=self.window.build(),
            counters=self.accounting.snapshot(len(self.pending), len(self.groups)),
            loop_lag_ms=self.probe.take_window(),
        )
        self.window = CohortBuilder()
        oldest_held = next(iter(self._open_entries.values()), self._stream_cursor)
        write = functools.partial(
            self._write_cut, manifest, batch_ids, self._checkpoint(), self.accounting.accounted, oldest_held
        )
        await asyncio.get_running_loop().run_in_executor(self._publisher, write)
        await self._enqueue(finalize, step)
        return manifest

    @functools.cached_property
    def _publisher_client(self) -> redis.Redis:
        """The publisher thread's own client (redis-py clients are not shared across threads)."""
        return connect_redis(self.settings.redis_url)

    def _write_cut(
        self,
        manifest: StepManifest,
        batch_ids: list[str],
        checkpoint: Checkpoint,
        accounted: int,
        oldest_held: str,
    ) -> None:
        """The cut's one transaction, on the publisher thread: at 16k rollouts packing the
        manifest and one SADD argument per rollout key take 50 ms, one pause on the loop;
        here the loop gets the GIL back between the pieces (`packb_in_pieces`)."""
        step = manifest.step
        manifest_key = self.keys.step(step, StepValue.MANIFEST)
        pipe = self._publisher_client.pipeline(transaction=True)
        pipe.set(manifest_key, manifest.to_bytes(), ex=self.store.ttl)
        pipe.sadd(self.keys.step_keys(step), manifest_key, *(self.keys.rollout(r) for r in batch_ids))
        pipe.expire(self.keys.step_keys(step), self.store.ttl)
        pipe.set(self.keys.next_step, step + 1)
        pipe.set(self.keys.checkpoint, checkpoint.to_bytes())
        pipe.set(self.keys.accounted, accounted)
        pipe.xtrim(self.keys.rollout_stream, minid=oldest_held)
        pipe.execute()

    def _checkpoint(self) -> Checkpoint:
        """The restart point as of now (orchestrator.checkpoint)."""
        return Checkpoint(
            cursor=self._stream_cursor,
            open_rollouts=frozenset(self._open_entries),
            pending=self.pending.build(),
            accounting=self.accounting.to_wire(),
        )

    async def _enqueue(self, task: Any, step: int, *args: Any) -> None:
        """`apply_async` blocks on the broker, so it runs on the publisher thread."""
        send = functools.partial(
            task.apply_async, (self.settings.run_id, step, *args), queue=self.config.cpu_queue
        )
        await asyncio.get_running_loop().run_in_executor(self._publisher, send)

    async def dispatch(self) -> None:
        """Cut steps while there are steps to ship, enough pending rollouts, and room in flight.

        Before cutting the next step, the previous cut's verdict is read (written by its
        finalize task; it is usually there by the time enough rollouts for another step
        are): a step the workers emptied is cut again under the same number."""
        while not self._stopping.is_set():
            last_cut = self.next_step >= self.end_step
            enough = len(self.pending) >= self.settings.batch_size
            # Read once there are rollouts for another cut (it is usually there by then), even
            # with the steps in flight at their limit: an empty step would hold it forever.
            if self._unsettled is not None and (enough or last_cut):
                await self.settle(self._unsettled)
                continue
            if last_cut:
                return
            if not enough or self.next_step - 1 - self.last_published > self.settings.max_async_level:
                self._work.clear()
                await self._work.wait()
                continue
            step = self.next_step
            await self.wait_for_policy(step)
            if not self._stopping.is_set() and await self.cut(step) is not None:
                self.next_step = step + 1
                self._unsettled = step

    async def settle(self, step: int) -> None:
        """Wait for step `step`'s verdict; if the workers dropped every one of its rollouts,
        take the cut back (`_take_back`) and stop the run after `max_empty_steps` in a row."""
        verdict: StepVerdict | None = None
        # A step already published shipped something; its release may have deleted the verdict.
        while verdict is None and step > self.last_published:
            if self._stopping.is_set():
                return
            raw = await self.client.get(self.keys.step(step, StepValue.VERDICT))
            if raw is None:
                await asyncio.sleep(POLL_SECONDS)
            else:
                verdict = StepVerdict.from_wire(msgpack.unpackb(raw, raw=False))
        self._unsettled = None
        if verdict is None or not verdict.empty:
            self.accounting.empty_in_a_row = 0
            return
        await self._take_back(step)
        in_a_row = self.accounting.empty_in_a_row
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
            self._abort(
                EmptySteps(
                    f"{in_a_row} consecutive steps had every rollout dropped by the workers (last: step "
                    f"{step}, {sum(verdict.dropped.values())} dropped, reason {reasons}); see the workers' "
                    "logs ('rollout ... dropped: ...') and the producers' payloads"
                )
            )

    async def _found_empty(self, step: int) -> bool:
        raw = await self.client.get(self.keys.step(step, StepValue.VERDICT))
        return raw is not None and StepVerdict.from_wire(msgpack.unpackb(raw, raw=False)).empty

    async def _take_back(self, step: int) -> None:
        """Undo the cut of an empty step: its rollouts are discarded (`empty_step`), its keys
        deleted, its window of `all` statistics and event-loop lag go to the next cut, and
        the step number is cut again. The manifest is read back from Redis, so a restarted
        orchestrator takes back a cut of its predecessor the same way."""
        manifest = StepManifest.from_bytes(await self._read_manifest(step))
        batch_ids = manifest.effective.labels["rollout_id"]
        self.accounting.empty_cut(len(batch_ids))
        self.accounting.stale_in_window += int(manifest.counters.get("off_policy/stale_dropped", 0))
        self.window = CohortBuilder.from_cohort(Cohort.concat([manifest.window, self.window.build()]))
        self.probe.put_back(manifest.loop_lag_ms)
        # The rollout log knows the rollouts this process cut (not a predecessor's).
        self.rollout_log.dropped_at_cut(self._cut_rollouts.pop(step, []), step, EMPTY_STEP)
        self.next_step = step
        step_keys = await self.client.smembers(self.keys.step_keys(step))
        pipe = self.client.pipeline(transaction=True)
        pipe.unlink(self.keys.step_keys(step), *step_keys)
        pipe.set(self.keys.next_step, step)
        pipe.set(self.keys.checkpoint, self._checkpoint().to_bytes())
        await pipe.execute()

    async def _read_manifest(self, step: int) -> bytes:
        raw = await self.client.get(self.keys.step(step, StepValue.MANIFEST))
        if raw is None:
            raise RunStateLost(self.settings.run_id, self.loss_report())
        return raw

    async def watch_stalled_steps(self) -> None:
        """Enqueue again the first task of a step that has made no progress for
        `stall_seconds`: a task message can be lost outright (a Redis that dies between
        handing a message to a worker and the worker receiving it), and the stages are
        idempotent, so the re-run skips what is done and redoes only what is missing.
        Each further re-run of the same stuck step waits twice as long (up to
        `STALL_BACKOFF_MAX_SECONDS`): a step that stays stuck mostly waits on something a
        re-run cannot fix (a trainer that stopped reading), and every re-run adds one more
        send retrying for it; but a re-run must never stop, or a twice-lost message hangs the run."""
        progress: dict[int, StepProgress] = {}
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), STALL_CHECK_SECONDS)
            steps = range(self.last_published + 1, self.next_step)
            pipe = self.client.pipeline(transaction=False)
            for step in steps:
                pipe.scard(self.keys.step_keys(step))
                pipe.scard(self.keys.sent(step))
            counts = await pipe.execute()
            now = time.monotonic()
            for index, step in enumerate(steps):
                marks = (counts[2 * index], counts[2 * index + 1])
                seen = progress.get(step)
                if seen is None or seen.marks != marks:
                    progress[step] = StepProgress(marks, now)
                    continue
                if step == self._unsettled and await self._found_empty(step):
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
                    await self._enqueue(finalize, step)
                    seen.since = now
            for step in [s for s in progress if s not in steps]:
                del progress[step]
            if self._stall_reason and all(seen.diagnosed < seen.since for seen in progress.values()):
                self._stall_reason = None
                await self.client.hdel(self.keys.status, "stall_reason")

    async def _diagnose(self, step: int, seconds: float) -> None:
        """Say why a step makes no progress (status `stall_reason` and the log); a Redis out
        of memory stops the run, since waiting cannot free it."""
        cause = await asyncio.get_running_loop().run_in_executor(
            self._diagnosis_thread, stall_reason, self._sync_client, self.settings
        )
        if cause is None and seconds < self.settings.stall_seconds:
            return  # most likely a long stage still running: nothing to say yet
        reason = f"step {step} made no progress for {seconds:.0f} s: {cause or 'cause not found'}"
        if reason != self._stall_reason:
            log.warning("%s", reason)
        self._stall_reason = reason
        await self.client.hset(self.keys.status, "stall_reason", reason)
        if "Redis is out of memory" in reason:
            self._abort(RedisOutOfMemory(reason))

    # -- records and release -----------------------------------------------------------

    async def follow_records(self) -> None:
        """Mirror published records to metrics.jsonl, print a line each, release each step."""
        cursor = "0-0"
        loop = asyncio.get_running_loop()
        while self.last_published < self.end_step - 1 and not self._stopping.is_set():
            response = await self.client.xread(
                {self.keys.metrics_stream: cursor}, count=16, block=READ_BLOCK_MS
            )
            for entry_id, fields in response[0][1] if response else []:
                cursor = entry_id.decode()
                record = json.loads(fields[b"record"])
                step = int(record["step"])
                if step <= self.last_published:
                    continue
                await loop.run_in_executor(self._monitor_thread, self.monitors.log, record)
                print(format_step_line(record), flush=True)
                self.records.append(record)
                self.records_published += 1
                self.tokens_shipped += int(record.get("progress/tokens", 0.0))
                self.last_published = step
                await self._log_shipped(step)
                self._work.set()
                await self.schedule_release(step)
                await self.client.set(self.keys.followed, step)
        await self.drain_release()

    async def _log_shipped(self, step: int) -> None:
        """Tell the rollout log which of the step's rollouts shipped (read before release)."""
        rollout_ids = self._cut_rollouts.pop(step, [])
        if self.rollout_log.enabled:
            raw_dropped = await self.client.get(self.keys.step(step, StepValue.DROPPED))
            dropped = msgpack.unpackb(raw_dropped or b"\x80")
            self.rollout_log.shipped(step, rollout_ids, dropped)

    async def schedule_release(self, step: int) -> None:
        """At most one release pending: wait for the previous one, then enqueue this one."""
        await self.drain_release()
        await self._enqueue_release(step)
        self._release_pending = asyncio.create_task(self._await_released(step))

    async def _enqueue_release(self, step: int) -> None:
        await self._enqueue(release, step, self.settings.ranks, self.settings.replay_steps)

    async def _await_released(self, step: int) -> None:
        """Until the step is released; its task is enqueued again after `stall_seconds`
        (the message can be lost with a Redis that dies, and release is idempotent)."""
        loop = asyncio.get_running_loop()
        resend_at = loop.time() + self.settings.stall_seconds
        while not await self.client.hexists(self.keys.released, step):
            if self._stopping.is_set():
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

    async def drain_release(self) -> None:
        if self._release_pending is not None:
            await self._release_pending
            self._release_pending = None

    async def release_acknowledged_payloads(self) -> list[int]:
        """At the end of the run, give the ranks `ack_timeout` seconds to acknowledge the
        last steps, then release every retained payload; return the steps never acknowledged.
        External trainers acknowledge nothing to Redis: their payloads go at once."""
        builtin = self.settings.trainers == "builtin"
        deadline = time.monotonic() + (self.settings.ack_timeout if builtin else 0.0)
        while await self.store.unacknowledged_steps() and time.monotonic() < deadline:
            await self.store.release_payloads(self.settings.ranks, self.last_published, evict_through=-1)
            await asyncio.sleep(POLL_SECONDS * 10)
        released = await self.store.release_payloads(
            self.settings.ranks, self.last_published, evict_through=self.last_published
        )
        if released.evicted_unacknowledged and builtin:
            log.error(
                "steps %s were never acknowledged by every rank within %.0f s",
                released.evicted_unacknowledged,
                self.settings.ack_timeout,
            )
        return released.evicted_unacknowledged if builtin else []

    async def release_unshipped(self) -> int:
        """At the end of the run every rollout still held (pending, in open groups, or not
        yet read from the stream) will never ship: release the payloads and the stream."""
        deleted = await self.store.delete_all_rollouts()
        await self.client.unlink(self.keys.rollout_stream, self.keys.checkpoint)
        if deleted:
            log.info("released %d unshipped rollouts at shutdown", deleted)
        return deleted

    async def end_run(self) -> None:
        """The run shipped every step: its tasks still queued are dropped (no alive mark), its
        id is marked used, and every key it leaves expires (`DEFAULT_TTL_SECONDS`)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.unlink(self.keys.alive)
        pipe.set(self.keys.finished, time.time())
        await pipe.execute()
        await self.store.expire_run()

    async def end_failed_run(self) -> None:
        """The run cannot go on (resuming it would meet the same input): its queued tasks are
        dropped (no alive mark), its held rollouts released, and every key it leaves expires."""
        await self.client.unlink(self.keys.alive)
        await self.release_unshipped()
        await self.store.expire_run()

    # -- lifecycle ---------------------------------------------------------------------

    async def hold_lease(self, acquired: asyncio.Event) -> None:
        """Hold the run's orchestrator lease while running: a second orchestrator of the
        same run (a restart racing a live one) waits instead of cutting the same steps."""
        token = f"{socket.gethostname()}:{os.getpid()}:{id(self)}"
        waiting_logged = False
        while not acquired.is_set():
            if await self.client.set(self.keys.orchestrator_lease, token, nx=True, ex=LEASE_SECONDS):
                await self.client.set(self.keys.run_marker, time.time(), nx=True)
                await self.client.set(self.keys.alive, token, ex=ALIVE_SECONDS)
                acquired.set()
                break
            if not waiting_logged:
                log.warning("run %s: another orchestrator holds the lease; waiting", self.settings.run_id)
                waiting_logged = True
            await asyncio.sleep(LEASE_SECONDS / 5)
        while not self._stopping.is_set():
            pipe = self.client.pipeline(transaction=False)
            pipe.exists(self.keys.run_marker)
            pipe.set(self.keys.orchestrator_lease, token, nx=True, ex=LEASE_SECONDS)
            pipe.get(self.keys.orchestrator_lease)
            pipe.set(self.keys.alive, token, ex=ALIVE_SECONDS)
            marker, _, holder, _ = await pipe.execute()
            if not marker:
                self._abort(RunStateLost(self.settings.run_id, self.loss_report()))
                return
            if holder != token.encode():
                self._abort(LeaseLost(f"run {self.settings.run_id}: another orchestrator took the lease"))
                return
            await self.client.expire(self.keys.orchestrator_lease, LEASE_SECONDS)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), LEASE_SECONDS / 5)
        await self.client.delete(self.keys.orchestrator_lease)

    def _abort(self, error: Exception) -> None:
        """Stop every loop at its next turn; `run` raises `error` once they have."""
        self._aborted = error
        self._stopping.set()
        self._work.set()

    def loss_report(self) -> dict[str, Any]:
        """What a Redis that came back empty took with it, as far as this process knows."""
        return {
            "steps_lost": list(range(self.last_published + 1, self.next_step)),
            "rollouts_lost_pending": self.pending.rollout_ids,
            "rollouts_lost_in_open_groups": list(self._open_entries),
            "records_read": self.accounting.arrived,
        }

    async def resume(self) -> None:
        """Pick up the run where a previous orchestrator left it (orchestrator.checkpoint):
        its counters and held rollouts, and the cut steps not yet published (their first
        task is enqueued again; the stages are idempotent)."""
        self.next_step = int(await self.client.get(self.keys.next_step) or self.start_step)
        self.last_published = int(await self.client.get(self.keys.followed) or self.start_step - 1)
        resumed_version = version_after(self.start_step - 1, self.settings.first_step)
        if resumed_version > 0:  # trainers resumed at start_step hold the steps before it
            await self.client.set(self.keys.policy_version, resumed_version, nx=True)
        raw = await self.client.get(self.keys.checkpoint)
        if raw is None:
            return
        checkpoint = Checkpoint.from_bytes(raw)
        self._resumed_from = checkpoint
        self.pending = CohortBuilder.from_cohort(checkpoint.pending)
        self.accounting = Accounting.from_wire(checkpoint.accounting)
        unpublished = [
            step
            for step in range(self.last_published + 1, self.next_step)
            if not await self.client.hexists(self.keys.published, step)
        ]
        for step in unpublished:
            await self._enqueue(finalize, step)
        if unpublished:
            self._unsettled = self.next_step - 1  # only the newest cut can be without its verdict
        log.warning(
            "run %s resumed: next step %d, %d pending rollouts, %d in open groups to re-read; "
            "steps %s enqueued again",
            self.settings.run_id,
            self.next_step,
            len(self.pending),
            len(checkpoint.open_rollouts),
            unpublished,
        )

    async def run(self) -> dict[str, Any]:
        """Ship `settings.steps` steps (counting from where the run left off); return a summary."""
        started = time.perf_counter()
        self.monitors = Monitors(self.settings)
        leased = asyncio.Event()
        lease = asyncio.create_task(self.hold_lease(leased))
        acquired = asyncio.create_task(leased.wait())
        await asyncio.wait({lease, acquired}, return_when=asyncio.FIRST_COMPLETED)
        if not leased.is_set():
            acquired.cancel()
            lease.result()  # the error that kept the lease from being taken (a Redis refusing writes)
        await self.resume()
        await self.client.set(self.keys.info, RunInfo.from_settings(self.settings).model_dump_json())
        await self.policy.update()  # the first gate decision needs no wait for the follower
        # The imports' and setup's objects (tens of thousands of functions, tuples, dicts)
        # live as long as the process: frozen, a full garbage collection no longer walks them,
        # and its pauses on the loop shrink (at 16k rollouts a step they were 17-33 ms).
        gc.freeze()
        probe = asyncio.create_task(self.probe.run())
        loops = [
            lease,
            asyncio.create_task(self.policy.follow(self._stopping)),
            asyncio.create_task(self.ingest()),
            asyncio.create_task(self.dispatch()),
            asyncio.create_task(self.watch_stalled_steps()),
        ]
        for task in loops:
            task.add_done_callback(self._abort_on_error)
        metrics_server = None
        try:
            if self.settings.metrics_port:
                # Imported here: it reads through orchestrator.progress, which imports this module.
                from orchestrator.exporter import serve_metrics

                metrics_server = serve_metrics(self)
            await self.follow_records()
        finally:
            self._stopping.set()
            self._work.set()
            probe.cancel()
            await asyncio.gather(probe, *loops, return_exceptions=True)
            self._publisher.shutdown(wait=True)
            if "_publisher_client" in self.__dict__:
                self._publisher_client.close()
            self._diagnosis_thread.shutdown(wait=True)
            self._monitor_thread.submit(self.monitors.close).result()
            self._monitor_thread.shutdown(wait=True)
            self.rollout_log.close()
            if metrics_server is not None:
                metrics_server.shutdown()
                metrics_server.server_close()
        if isinstance(self._aborted, RunStateLost):
            path = Path(self.settings.output_dir) / "lost.json"
            path.write_text(json.dumps(self._aborted.report, indent=1))
            log.error("%s; the list is in %s", self._aborted, path)
        if isinstance(self._aborted, EmptySteps):
            await self.end_failed_run()
        if self._aborted is not None:
            raise self._aborted
        unacknowledged = await self.release_acknowledged_payloads()
        await self.release_unshipped()
        await self.end_run()
        return {
            "steps_unacknowledged": unacknowledged,
            "steps_shipped": self.records_published,
            "records_published": self.records_published,
            "tokens_shipped": self.tokens_shipped,
            "empty_steps": self.accounting.empty_steps,
            "wall_seconds": time.perf_counter() - started,
            "loop_lag_max_ms": self.probe.max_ms,
        }


def _rollout_id_of(raw: bytes) -> str | None:
    """The rollout id of a rejected record, if it names a well-formed one (to release it)."""
    try:
        value = json.loads(raw).get("rollout_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and IDENTIFIER.fullmatch(value) else None


# Record times that are not a stage's (wait_for_ckpt: prime-rl's name of the policy wait).
NOT_STAGES = ("time/ship", "time/wait_for_policy", "time/wait_for_ckpt")


def format_step_line(record: dict[str, float]) -> str:
    stages = " ".join(
        f"{name.split('/', 1)[1]} {seconds:.2f}s"
        for name, seconds in sorted(record.items())
        if name.startswith("time/") and name not in NOT_STAGES
    )
    return (
        f"step {int(record['step'])} | rollouts {int(record.get('progress/rollouts', 0))} | "
        f"tokens {int(record.get('progress/tokens', 0)):,} | "
        f"reward {record.get('train/agg/effective/reward/mean', float('nan')):.3f} | {stages} | "
        f"ship {record.get('time/ship', 0.0):.2f}s | "
        f"policy wait {record.get('time/wait_for_policy', 0.0):.2f}s | "
        f"loop lag max {record.get('event_loop_lag/max_ms', 0.0):.1f} ms"
    )
