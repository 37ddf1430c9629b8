"""The publish and release tasks: one record per step, written in one transaction guarded
by the `published` hash (exactly once, steps in order), with the step's sample lines; then
the step's keys, payloads past the replay window and rows files released.
"""

from __future__ import annotations

import json
import logging
import time

import msgpack
import redis

from tasks.cohort import Cohort
from tasks.context import StepContext, stage_task
from tasks.send import RETRY_SECONDS
from tasks.stages.publish import build_record, running_totals
from tasks.stages.release import trim_process_memory
from tasks.stages.samples import write_samples
from transport.keys import StepValue, stage_of_field
from transport.payload_dir import PayloadDirectory
from transport.payload_segments import RunRows
from transport.store import PayloadMissingError

log = logging.getLogger("rlship.tasks")

# Records kept in the Redis stream (followers read them within seconds; metrics.jsonl and
# W&B keep them all): a run of any length holds a bounded history in Redis.
RECORDS_KEPT = 1000


def _stage_seconds(times: dict[bytes, bytes]) -> dict[str, float]:
    """Per-stage seconds; a per-rank stage counts as its slowest rank."""
    out: dict[str, float] = {}
    for field, value in times.items():
        stage = stage_of_field(field.decode())
        out[stage] = max(out.get(stage, 0.0), float(value))
    return out


@stage_task("publish", computes=False, max_retries=None)
def publish(ctx: StepContext) -> None:
    """Write the step's one record to the metrics stream, exactly once, in step order."""
    started = time.perf_counter()
    step, manifest, keys = ctx.step, ctx.manifest, ctx.keys
    if manifest.prev_step >= 0 and not ctx.is_published(manifest.prev_step):
        raise ctx.retry(countdown=RETRY_SECONDS, queue=manifest.config.cpu_queue)
    _write_step_samples(ctx)
    # The step counts as published (the orchestrator goes on, sinks get the record) once a
    # replica holds the record: lost in a failover, it is written again, once.
    ctx.durability.replicate(
        ctx.client,
        lambda: _write_record(ctx, started),
        lambda pipe: pipe.hexists(keys.published, step),
        f"step {step}'s record",
    )


def _write_step_samples(ctx: StepContext) -> None:
    """The step's samples file, from the lines each rank's encode left (in position order)."""
    config = ctx.manifest.config
    if config.samples_per_step <= 0:
        return
    names = [ctx.keys.step(ctx.step, f"{StepValue.SAMPLES}:{rank}") for rank in range(config.ranks)]
    held = [msgpack.unpackb(value, raw=False) for value in ctx.client.mget(names) if value is not None]
    lines = [
        line for _, line in sorted((pair for rank_lines in held for pair in rank_lines), key=lambda p: p[0])
    ]
    if lines:
        write_samples(config.output_path, ctx.step, lines)


def _stage_seconds_fields(step: int, seconds: dict[str, float]) -> dict[str, float]:
    """`RunKeys.stage_seconds`' fields of a step: `{step}:{stage}` (and `{step}:ship`)."""
    return {f"{step}:{name}": value for name, value in seconds.items()}


def _write_record(ctx: StepContext, started: float) -> None:
    """The record and the `published` mark, in one transaction guarded by that mark; the
    step's stage seconds, publish's own (until now) and `time/ship` for the orchestrator's
    histograms (`RunKeys.stage_seconds`)."""
    step, manifest, keys = ctx.step, ctx.manifest, ctx.keys
    step_record = ctx.get(StepValue.METRICS)
    stage_seconds = _stage_seconds(ctx.client.hgetall(keys.times(step)))
    with ctx.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.published, keys.totals)
                if pipe.hexists(keys.published, step):  # a concurrent copy won the race
                    pipe.unwatch()
                    ctx.skip_redundant("publish", "published")
                    return
                previous = {k.decode(): float(v) for k, v in pipe.hgetall(keys.totals).items()}
                totals = running_totals(previous, step_record)
                ship_seconds = time.time() - manifest.cut_time
                record = build_record(
                    step,
                    step_record,
                    stage_seconds,
                    ship_seconds,
                    manifest.policy_wait,
                    totals,
                    names=manifest.config.record_names,
                )
                pipe.multi()
                pipe.xadd(
                    keys.metrics_stream,
                    {"step": step, "record": json.dumps(record)},
                    maxlen=RECORDS_KEPT,
                    approximate=True,
                )
                pipe.hset(keys.published, step, time.time())
                pipe.hset(keys.totals, mapping=totals)
                timed = stage_seconds | {"publish": time.perf_counter() - started, "ship": ship_seconds}
                pipe.hset(keys.stage_seconds, mapping=_stage_seconds_fields(step, timed))
                for written in (keys.metrics_stream, keys.published, keys.totals, keys.stage_seconds):
                    pipe.expire(written, ctx.store.ttl)
                pipe.execute()
                ctx.crash_if_armed("publish")
                return
            except redis.WatchError:
                continue


def _released_already(ctx: StepContext, task: str) -> bool:
    """Release runs for a published step, whether or not its run has ended, once."""
    pipe = ctx.client.pipeline(transaction=False)
    pipe.hexists(ctx.keys.released, ctx.step)
    if ctx.first_read(pipe, task)[0]:
        ctx.skip_redundant(task, "released")
        return True
    return False


def _report_evicted(ctx: StepContext, steps: list[int]) -> None:
    """Count steps evicted unacknowledged; a warning the first time in a run, then info:
    ranks that never acknowledge (prime-rl's stock receivers) make it every step."""
    pipe = ctx.client.pipeline(transaction=True)
    pipe.hincrby(ctx.keys.evicted, "steps", len(steps))
    pipe.expire(ctx.keys.evicted, ctx.store.ttl)
    evicted = pipe.execute()[0]
    what = "steps %s evicted from the replay window before every rank acknowledged them (%d in this run)"
    if evicted > len(steps):
        log.info(what, steps, evicted)
        return
    log.warning(
        what + "; a rank restarting now cannot replay them; ranks that never acknowledge (stock "
        "receivers) evict every step: later ones are logged at info",
        steps,
        evicted,
    )


def _payload_directory(ctx: StepContext) -> PayloadDirectory | None:
    """Where the run retains payloads, if in files; read before the step's keys go (a
    redelivered release that finds them gone leaves the files to the run's end)."""
    try:
        return ctx.manifest.config.payload_directory(ctx.run_id)
    except PayloadMissingError:
        return None


def _release_dropped_rows(ctx: StepContext) -> RunRows | None:
    """The run's rows files of the step's rollouts that did not ship go now; those that
    shipped stay with the step's retained payloads (a rank may replay the step). None: the
    run has no rows files, or this is a redelivered release that found the step's keys gone
    (the first delivery did this; the run's end removes what a crash left)."""
    try:
        rows = ctx.manifest.config.run_rows(ctx.run_id)
        if rows is None or not rows.exists():
            return None
        shipped = Cohort.from_wire(ctx.get(StepValue.PRUNED)["samples"]).labels["rollout_id"]
    except PayloadMissingError:
        return None
    kept = set(shipped)
    rows.unlink(rid for rid in ctx.manifest.effective.labels["rollout_id"] if rid not in kept)
    ctx.store.hold_rows(ctx.step, list(shipped))
    return rows


@stage_task("release", computes=False, skip=_released_already)
def release(ctx: StepContext, ranks: int, replay_steps: int) -> None:
    """Delete every key of a published step but its per-rank payloads; release the payloads
    of every step all ranks have acknowledged (and, past the retention bound, of older steps
    regardless); trim the heap; mark the step released."""
    started, step = time.perf_counter(), ctx.step
    rows = _release_dropped_rows(ctx)
    directory = _payload_directory(ctx)
    deleted = ctx.store.delete_step(step)
    payloads = ctx.store.release_payloads(
        ranks, step, evict_through=step - replay_steps, rows=rows, directory=directory
    )
    if payloads.evicted_unacknowledged:
        _report_evicted(ctx, payloads.evicted_unacknowledged)
    ctx.crash_if_armed("release")
    trim_process_memory()
    pipe = ctx.client.pipeline(transaction=True)
    pipe.hset(ctx.keys.released, step, time.time())
    pipe.expire(ctx.keys.released, ctx.store.ttl)
    released_in = {"release": time.perf_counter() - started}
    pipe.hset(ctx.keys.stage_seconds, mapping=_stage_seconds_fields(step, released_in))
    pipe.expire(ctx.keys.stage_seconds, ctx.store.ttl)
    ctx.count_call("release", pipe)
    pipe.execute()
    log.info("step %d released: %d keys deleted, payloads of %d steps", step, deleted, payloads.steps)
