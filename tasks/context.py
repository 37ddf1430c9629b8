"""What every stage task shares: a step's context (`StepContext`) and the one seam each
stage task goes through (`stage_task`), so a task body is just its stage.

Delivery is at-least-once and unordered after a crash, so every task is idempotent: a
stage whose completion mark exists is not computed again but still enqueues its
successors (the previous run may have died between the two); fan-in is counted by
whoever completes (`StepContext.completed`); a task of a published step or of an ended
run does nothing. Messages carry (run_id, step[, rank]) only.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import msgpack
import redis
from celery import Task
from celery.exceptions import Retry

from tasks import tracing
from tasks.app import app, redis_url
from tasks.faults import crash_if_armed
from tasks.graph import STAGE, Stage, predecessors, stage_ranks, task_stages
from tasks.manifest import HEAD_BYTES, StepManifest
from transport.connection import connect_redis
from transport.keys import StepValue, stage_field
from transport.replication import Durability
from transport.run_files import DiskFull, restrict
from transport.store import PayloadStore
from transport.task_metrics import note_failure, note_queue_wait, queue_wait_seconds

log = logging.getLogger("rlship.tasks")
T = TypeVar("T")


@functools.cache
def redis_client() -> redis.Redis:
    """One connection pool per worker process (created after fork, on first use)."""
    return connect_redis(redis_url(), socket_timeout=120, health_check_interval=30)


# The step cuts this process holds, by (run, step): the bytes that open each manifest (its
# cut's id, `manifest.HEAD_BYTES`), the manifest, and the step values decoded under that cut
# (`StepContext.decoded`). Every task of a step needs the manifest, and a seed-sized one is
# over a megabyte: a process reads it whole once per cut, then only its head to see it is
# still the step's. A step cut again under its number (found empty) is a new cut: what was
# decoded under the old one goes with it. A few steps are in flight at once.
@dataclass(frozen=True)
class HeldCut:
    head: bytes
    manifest: StepManifest
    decoded: dict[str, Any] = field(default_factory=dict)


_cuts: dict[tuple[str, int], HeldCut] = {}
CUTS_KEPT = 8


def held_cut(client: redis.Redis, store: PayloadStore, step: int) -> HeldCut:
    """Step `step`'s cut, its manifest read whole only if this process does not hold it."""
    key = store.keys.step(step, StepValue.MANIFEST)
    head = client.getrange(key, 0, HEAD_BYTES - 1)
    held = _cuts.get((store.keys.run_id, step))
    if held is not None and head and held.head == head:
        return held
    data = bytes(store.get_step_value(step, StepValue.MANIFEST))
    held = HeldCut(data[:HEAD_BYTES], StepManifest.from_bytes(data))
    _cuts[(store.keys.run_id, step)] = held
    while len(_cuts) > CUTS_KEPT:
        del _cuts[next(iter(_cuts))]
    return held


class StepContext:
    """A task's view of one step: the manifest, the store and the step's marks."""

    def __init__(self, run_id: str, step: int, task: Task | None = None) -> None:
        self.run_id = run_id
        self.step = step
        self.task = task  # the delivery being run, for its retries; None outside a worker
        self.client = redis_client()
        self.store = PayloadStore(self.client, run_id)
        self.keys = self.store.keys
        # What this delivery stored (packed, by step value): a carried stage takes it from
        # here rather than reading it back through Redis.
        self.stored: dict[str, bytes] = {}

    @functools.cached_property
    def cut(self) -> HeldCut:
        """The step's cut as this process holds it. Every task reads it before it writes a
        file, so the process creates files with the run's `file_mode` from here (a worker may
        serve several runs)."""
        cut = held_cut(self.client, self.store, self.step)
        restrict(cut.manifest.config.file_mode)
        return cut

    @property
    def manifest(self) -> StepManifest:
        return self.cut.manifest

    @functools.cached_property
    def durability(self) -> Durability:
        """How many replicas hold a mark before the task acts on it (`transport.replication`)."""
        return Durability.of(self.manifest.config, self.keys.replication_probe)

    def is_published(self, step: int | None = None) -> bool:
        return bool(self.client.hexists(self.keys.published, self.step if step is None else step))

    def put(self, name: str, value: Any) -> None:
        packed = msgpack.packb(value, use_bin_type=True)
        self.store.put_step_value(self.step, name, packed)
        self.stored[name] = packed

    def get(self, name: str) -> Any:
        packed = self.stored.get(name)
        return msgpack.unpackb(
            self.store.get_step_value(self.step, name) if packed is None else packed, raw=False
        )

    def decoded(self, name: str, decode: Callable[[Any], T]) -> T:
        """`decode` of a step value written once per cut (the pruned samples, the pack plan),
        made once per process and cut."""
        decoded = self.cut.decoded
        if name not in decoded:
            decoded[name] = decode(self.get(name))
        return cast(T, decoded[name])

    def crash_if_armed(
        self, stage: str, rank: int | None = None, before: Callable[[], None] | None = None
    ) -> None:
        crash_if_armed(self.client, self.run_id, stage, self.step, rank, before)

    def retry(self, countdown: float, queue: str) -> Retry:
        """The delivery's retry, `countdown` seconds from now on `queue`, for the task to raise."""
        if self.task is None:
            raise RuntimeError(f"step {self.step}: a retry needs the task's delivery (not a direct call)")
        return self.task.retry(countdown=countdown, queue=queue)

    @property
    def retries(self) -> int:
        """How many times this delivery has been retried already."""
        return 0 if self.task is None else int(self.task.request.retries or 0)

    def first_read(self, pipe: Any, stage: str) -> list[Any]:
        """Execute the pipeline of a stage task's first read (its skip check) with what rides
        on it, no round trip of their own: the task counted (`count_served`) and the spans
        this process ended since its last first read (`tracing.ride_spans`). The replies."""
        self.count_served(pipe, stage)
        riding = tracing.ride_spans(pipe, self.run_id)
        try:
            replies = pipe.execute()
        except Exception:
            riding.failed()
            raise
        riding.landed(replies)
        return replies

    def count_served(self, pipe: Any, stage: str) -> None:
        """Count the task in the run's `served_by` (the worker's node name), its wait in its
        queue, and a redelivery (its previous delivery was lost with its worker) as a failure
        of `stage`, on the pipeline of the task's first read (`first_read`). The keys expire
        like the step keys: a task of a run long gone must not leave a key for ever."""
        request = self.task.request if self.task is not None else None
        worker = (request.hostname if request is not None else None) or socket.gethostname()
        pipe.hincrby(self.keys.served_by, worker, 1)
        pipe.expire(self.keys.served_by, self.store.ttl, nx=True)
        if request is None:
            return
        waited = queue_wait_seconds(request, time.time())
        if waited is not None:
            note_queue_wait(pipe, self.keys, STAGE[stage].queue, waited, self.store.ttl)
        if (request.delivery_info or {}).get("redelivered"):
            note_failure(pipe, self.keys, self.stage_lost_in(stage), self.store.ttl)

    def stage_lost_in(self, stage: str) -> str:
        """The stage a lost delivery of `stage`'s task was in: of the stages the task runs
        (`task_stages`: it and those it carries), the first not done, else the last."""
        stages = task_stages(stage)
        if len(stages) == 1:
            return stage
        pipe = self.client.pipeline(transaction=False)
        for name in stages:
            pipe.exists(self.keys.done(self.step, name))
        return next((name for name, done in zip(stages, pipe.execute(), strict=True) if not done), stages[-1])

    def count_failure(self, stage: str) -> None:
        """Count a delivery of `stage` that raised (`rlship_task_failures_total`)."""
        pipe = self.client.pipeline(transaction=False)
        note_failure(pipe, self.keys, stage, self.store.ttl)
        pipe.execute()

    def count_call(self, stage: str, pipe: Any = None) -> None:
        """Count that this process ran `stage` (`stage_calls`: nothing runs twice), on `pipe`
        if given (a pipeline with no command yet is falsy, hence the explicit test)."""
        target = self.client.pipeline(transaction=True) if pipe is None else pipe
        target.hincrby(self.keys.stage_calls, f"{socket.gethostname()}:{os.getpid()}:{stage}", 1)
        target.expire(self.keys.stage_calls, self.store.ttl)
        if pipe is None:
            target.execute()

    def run_stage(
        self,
        stage: str,
        compute: Callable[[], dict[str, Any] | None],
        rank: int | None = None,
        watch: str | None = None,
    ) -> bool:
        """Run `compute` once per step (per mark); record its seconds and who ran it.

        What `compute` returns (name -> value) is stored with the mark, in one transaction.
        With `watch`, that transaction is guarded by the key: if it changed meanwhile (the
        step was found empty and cut again), nothing is written and False is returned."""
        name = stage_field(stage, rank)
        mark = self.keys.done(self.step, stage, rank)
        with self.client.pipeline(transaction=True) as pipe:
            if watch is not None:
                pipe.watch(watch)
            if self.client.exists(mark):
                log.info("step %d: %s already done, re-enqueueing its successors", self.step, name)
                return True
            started = time.perf_counter()
            outputs = compute() or {}
            seconds = time.perf_counter() - started
            self.crash_if_armed(stage, rank)  # the worst moment: computed, not yet marked
            pipe.multi()
            packed = {output: msgpack.packb(value, use_bin_type=True) for output, value in outputs.items()}
            for output, value in packed.items():
                pipe.set(self.keys.step(self.step, output), value, ex=self.store.ttl)
                pipe.sadd(self.keys.step_keys(self.step), self.keys.step(self.step, output))
            pipe.hset(self.keys.times(self.step), name, seconds)
            pipe.expire(self.keys.times(self.step), self.store.ttl)
            pipe.sadd(self.keys.step_keys(self.step), self.keys.times(self.step))
            pipe.set(mark, seconds, ex=self.store.ttl)
            pipe.sadd(self.keys.step_keys(self.step), mark)
            if rank is not None:
                marked = self.keys.marked_ranks(self.step, stage)
                pipe.rpush(marked, rank)
                pipe.expire(marked, self.store.ttl)
                pipe.sadd(self.keys.step_keys(self.step), marked)
            pipe.expire(self.keys.step_keys(self.step), self.store.ttl)
            self.count_call(stage, pipe)
            try:
                pipe.execute()
            except redis.WatchError:
                return False
        self.stored.update(packed)
        return True

    def stop_run(self, problem: str) -> None:
        """The run cannot go on (`PayloadStore.stop_run`); the task ends without a retry, its
        step's marks as they were, so the run resumes where it stopped."""
        log.error("step %d: %s; the run stops", self.step, problem)
        self.store.stop_run(problem)

    def skip_redundant(self, task: str, done: str) -> None:
        log.info("step %d: %s arrived after the step was %s; nothing to do", self.step, task, done)
        pipe = self.client.pipeline(transaction=True)
        pipe.hincrby(self.keys.redundant, task, 1)
        pipe.expire(self.keys.redundant, self.store.ttl)
        pipe.execute()

    def skip(self, task: str) -> bool:
        """Whether the task has nothing to do: its step is published, or its run has ended
        (no live orchestrator: finished, failed to start, or killed). A task of an ended run
        is dropped and counted, never retried: workers serve many runs, and a dead run's
        retrying sends would otherwise loop forever."""
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(self.keys.alive)
        pipe.hexists(self.keys.published, self.step)
        alive, published, *_ = self.first_read(pipe, task)
        if not alive:
            log.warning("run %s has ended: %s of step %d dropped", self.run_id, task, self.step)
            pipe.hincrby(self.keys.tasks_dropped, task, 1)
            pipe.expire(self.keys.tasks_dropped, self.store.ttl)
            pipe.execute()
            return True
        if published:
            self.skip_redundant(task, "published")
        return bool(published)

    def completed(self, stages: Iterable[Stage]) -> bool:
        """Whether every one of `stages` is done for the step (every rank of a per-rank one),
        read in one round trip: a marked stage by its marks, send by its `sent` set."""
        ranks = self.manifest.config.ranks
        pipe = self.client.pipeline(transaction=False)
        wanted = []
        for stage in stages:
            if stage.marked:
                for rank in stage_ranks(stage, ranks):
                    pipe.exists(self.keys.done(self.step, stage.name, rank))
                    wanted.append(1)
            else:
                pipe.scard(self.keys.sent(self.step))
                wanted.append(ranks)
        return all(got >= want for got, want in zip(pipe.execute(), wanted, strict=True))

    def queue(self, stage: Stage) -> str:
        config = self.manifest.config
        return config.ship_queue if stage.queue == "ship" else config.cpu_queue


def go_on(ctx: StepContext, stage: Stage, rank: int | None) -> None:
    """What follows `stage` in the graph: a carried stage is run here and now (then what
    follows it); any other is enqueued, for the same rank after a per-rank stage, for every
    rank after a per-step one; a fan-in (more than one predecessor, or a per-step stage after
    a per-rank one) once all its predecessors are done. More than one task may see a fan-in
    complete; the stage behind it runs once all the same."""
    for successor in (STAGE[name] for name in stage.then):
        if successor.by_orchestrator:
            continue
        if successor.carried:
            attributes = {
                "rlship.run_id": ctx.run_id,
                "rlship.stage": successor.name,
                "rlship.step": ctx.step,
            }
            with tracing.span(successor.task_name, **attributes):
                _run_body(ctx, successor, _CARRIED[successor.name], None, ())
                go_on(ctx, successor, None)
            continue
        before = predecessors(successor.name)
        if (len(before) > 1 or (stage.per_rank and not successor.per_rank)) and not ctx.completed(before):
            continue
        # The successor's instances that waited for this one: the same rank, or all of them.
        same_rank = stage.per_rank and successor.per_rank
        ranks = (rank,) if same_rank else stage_ranks(successor, ctx.manifest.config.ranks)
        task, queue = app.tasks[successor.task_name], ctx.queue(successor)
        for each in ranks:
            task.apply_async((ctx.run_id, ctx.step, *(() if each is None else (each,))), queue=queue)


Body = Callable[..., Any]
# The bodies of carried stages (`Stage.carried`), run by `go_on` in their carrier's task.
_CARRIED: dict[str, Body] = {}


def _run_body(
    ctx: StepContext, stage: Stage, body: Body, rank: int | None, args: tuple[int, ...], computes: bool = True
) -> bool:
    """One stage's body: through `run_stage` if it `computes`; False if the step goes no
    further. A body that raises is counted as a failure of its own stage."""
    try:
        if computes:
            ctx.run_stage(stage.name, functools.partial(body, ctx, *args), rank)
            return True
        return body(ctx, *args) is not False
    except (DiskFull, Retry):
        raise
    except Exception:
        ctx.count_failure(stage.name)
        raise


def stage_task(
    name: str,
    *,
    computes: bool = True,
    skip: Callable[[StepContext, str], bool] = StepContext.skip,
    **options: Any,
) -> Callable[[Body], Any]:
    """Register `body` as stage `name`'s Celery task (`Stage.task_name`): the one seam; or,
    for a carried stage, as the body its carrier's task runs (`go_on`), returned as is.

    Per delivery: the step's context; `skip` (by default: the step is published or the run
    has ended), which also counts the worker in the run's `served_by` (`count_served`: which
    workers took its tasks); the body (a write it makes that finds its disk full stops the
    run: `StepContext.stop_run`); then what follows the stage in the graph (`go_on`). A body
    that `computes` is the stage's computation, run once per step by `StepContext.run_stage`
    (timed, marked, the fault hook before the mark); any other runs its stage itself and
    returns False when the step goes no further. The body gets the context and the task's
    arguments after (run_id, step)."""
    stage = STAGE[name]

    def register(body: Body) -> Any:
        if stage.carried:
            _CARRIED[name] = body
            return body

        @functools.wraps(body)
        def run(task: Task, run_id: str, step: int, *args: int) -> None:
            ctx = StepContext(run_id, step, task)
            if skip(ctx, name):
                return
            rank = args[0] if stage.per_rank else None
            try:
                if _run_body(ctx, stage, body, rank, args, computes):
                    go_on(ctx, stage, rank)
            except DiskFull as exc:
                ctx.stop_run(str(exc))

        # The task's own arguments, for what reads them by name (`tasks.logs.TaskContext`
        # puts run_id, step and rank on every log line), not the body's `ctx, ...`.
        positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
        named = [inspect.Parameter(n, positional) for n in ("task", "run_id", "step")]
        after_context = list(inspect.signature(body).parameters.values())[1:]
        run.__signature__ = inspect.Signature([*named, *after_context])
        return app.task(name=stage.task_name, bind=True, **options)(run)

    return register
