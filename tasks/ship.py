"""The ship path's tasks. The compute stages are here, each body its stage: loading inputs
from Redis, calling a stage function (`tasks.stages`) and storing its output; `send` is in
`tasks.send`, `publish` and `release` in `tasks.publish`, and this module names them all, so
the orchestrator and the Celery app know one module of task signatures. What every task
does around its stage (context, skips, timing and marks, successors) is
`tasks.context.stage_task`; which stage follows which, and which run in the task before
them (prune and pack, in finalize's), is `tasks.graph`.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from tasks.app import app
from tasks.cohort import Cohort
from tasks.context import StepContext, redis_client, stage_task
from tasks.publish import publish, release
from tasks.send import send
from tasks.stages.encode import (
    SampleWire,
    assemble_rank,
    encode_rank,
    prepare_samples,
    rank_rollout_ids,
    rank_segments,
    with_inline_rows,
)
from tasks.stages.finalize import (
    StepVerdict,
    finalize_step,
    rollouts_to_read,
    rollouts_with_facts,
    rollouts_with_handles,
    step_drops,
    step_verdict,
)
from tasks.stages.metrics import step_metrics
from tasks.stages.pack import PackPlan, pack_samples
from tasks.stages.prune import drop_field, prune_samples, worker_drops
from tasks.stages.samples import choose_samples, sample_lines
from transport.checksum import payload_checksum
from transport.keys import DEFAULT_TTL_SECONDS, StepValue
from transport.outcomes import cut_into, dropped_at, record_outcomes
from transport.payload_segments import PAYLOAD_FIELD, digests_checksum
from transport.store import PayloadMissingError, PayloadStore
from transport.task_metrics import note_queue_wait, queue_wait_seconds

log = logging.getLogger("rlship.tasks")


def _finalized(ctx: StepContext) -> dict[str, Any]:
    manifest = ctx.manifest
    stored = ctx.store.stored_sizes(rollouts_with_facts(manifest.effective))
    to_read = rollouts_to_read(manifest.effective, stored)
    with_handles = rollouts_with_handles(manifest.effective, to_read, manifest.config.side_arrays)
    fetched = ctx.store.fetch_rollouts([*to_read, *with_handles])  # one round trip
    payloads = {rollout_id: fetched[rollout_id] for rollout_id in to_read}
    handles = {rollout_id: fetched[rollout_id] for rollout_id in with_handles}
    result = finalize_step(manifest, payloads, handles)
    for rollout_id, reason in result.failures.items():
        log.warning("step %d: rollout %s dropped: %s", ctx.step, rollout_id, reason)
    # What became of each cut rollout, for its producer (`RolloutProducer.outcome`).
    drops = step_drops(result)
    outcomes = dict.fromkeys(manifest.effective.labels["rollout_id"], cut_into(ctx.step))
    outcomes |= {rid: dropped_at(ctx.step, reason, drop_field(reason)) for rid, reason in drops.items()}
    pipe = ctx.client.pipeline(transaction=False)
    record_outcomes(pipe, ctx.keys, outcomes, manifest.config.dedupe_horizon, DEFAULT_TTL_SECONDS)
    pipe.execute()
    return {
        StepValue.FINALIZED: {"samples": result.samples.to_wire(), "failures": result.failures},
        StepValue.VERDICT: step_verdict(result).to_wire(),
    }


@app.task(name="rlship.prepare", ignore_result=True)
def prepare(run_id: str, rollout_ids: list[str]) -> None:
    """Before the cut: the wire parts of rollouts whose groups just completed trainable, so
    that at the cut their ranks' payloads are joined rather than encoded. Their arrays are
    read here, once (their values were checked by the producer, or are checked at the cut);
    a rollout malformed in shape, with optional streams or gone is left for the encoder to
    build from its arrays."""
    store = PayloadStore(redis_client(), run_id)
    waited = queue_wait_seconds(prepare.request, time.time())
    if waited is not None:
        pipe = store.client.pipeline(transaction=False)
        note_queue_wait(pipe, store.keys, "cpu", waited, store.ttl)
        pipe.execute()
    found = store.fetch_rollouts(rollout_ids)
    arrays = {rollout_id: a for rollout_id, a in found.items() if not isinstance(a, Exception)}
    wires = {rollout_id: wire.to_bytes() for rollout_id, wire in prepare_samples(arrays).items()}
    store.put_sample_wires(wires)


@stage_task("finalize", computes=False)
def finalize(ctx: StepContext) -> bool:
    """Check the cut rollouts and write the step's verdict with the mark: an empty step goes
    no further (the orchestrator cuts its number again), any other goes on to prune."""
    try:
        manifest_key = ctx.keys.step(ctx.step, StepValue.MANIFEST)
        written = ctx.run_stage("finalize", functools.partial(_finalized, ctx), watch=manifest_key)
        verdict = StepVerdict.from_wire(ctx.get(StepValue.VERDICT)) if written else None
    except PayloadMissingError:
        verdict = None
    if verdict is None:
        # The manifest changed or went while this copy ran: the step was found empty
        # (by an earlier copy) and its number is being cut again; that cut has its own task.
        ctx.skip_redundant("finalize", "found empty and cut again")
        return False
    if verdict.empty:
        log.warning("step %d: every cut rollout was dropped %s; not shipped", ctx.step, verdict.dropped)
        return False
    return True


@stage_task("prune")
def prune(ctx: StepContext) -> None:
    finalized = ctx.get(StepValue.FINALIZED)
    samples, pruned = prune_samples(Cohort.from_wire(finalized["samples"]))
    ctx.put(StepValue.PRUNED, {"samples": samples.to_wire()})
    # Apart from the samples: the orchestrator's rollout log reads just this.
    ctx.put(StepValue.DROPPED, worker_drops(finalized["failures"], pruned))


def _pruned(ctx: StepContext) -> Cohort:
    """The step's samples after prune: what metrics, pack and each rank's encode read."""
    return ctx.decoded(StepValue.PRUNED, lambda pruned: Cohort.from_wire(pruned["samples"]))


@stage_task("metrics")
def metrics(ctx: StepContext) -> None:
    shipped = _pruned(ctx)
    dropped = list(ctx.get(StepValue.DROPPED).values())
    ctx.put(StepValue.METRICS, step_metrics(ctx.manifest, shipped, dropped))


@stage_task("pack")
def pack(ctx: StepContext) -> None:
    config = ctx.manifest.config
    samples = _pruned(ctx)
    plan = pack_samples(samples.numeric["num_tokens"], config.ranks, config.seq_len, config.pad_to_multiple)
    ctx.put(StepValue.PLAN, plan.to_wire())


@stage_task("encode")
def encode(ctx: StepContext, rank: int) -> None:
    """The rank's payload, joined from its samples' wire parts made before the cut
    (`prepare`); a sample without them has its arrays read and its parts made here, and a
    rank holding a sample of optional streams is built from the arrays."""
    plans = ctx.decoded(StepValue.PLAN, PackPlan.from_wire).ranks[rank]
    samples = _pruned(ctx)
    wire = ctx.manifest.config.wire_profile
    ids = rank_rollout_ids(plans, samples)
    wires = {rid: SampleWire.from_bytes(data) for rid, data in ctx.store.get_sample_wires(ids).items()}
    arrays = ctx.store.get_rollouts([rid for rid in ids if rid not in wires])
    wires |= prepare_samples(arrays)
    if len(wires) == len(ids):
        payload: bytes | memoryview = assemble_rank(plans, samples, wires, wire)
        segments = rank_segments(plans, samples, {rid: w.segments for rid, w in wires.items()})
    else:
        arrays |= ctx.store.get_rollouts([rid for rid in ids if rid not in arrays])
        arrays = with_inline_rows(arrays)
        payload = encode_rank(plans, samples, arrays, wire)
        segments = rank_segments(plans, samples, {rid: a.get(PAYLOAD_FIELD, []) for rid, a in arrays.items()})
    checksum = payload_checksum(payload)
    config = ctx.manifest.config
    rows_bytes = sum(segment.nbytes for segment in segments)
    ctx.store.put_payload(ctx.step, rank, payload, config.payload_directory(ctx.run_id), checksum, rows_bytes)
    pipe = ctx.client.pipeline(transaction=False)
    pipe.hset(ctx.keys.sent_checksums, f"{ctx.step}:{rank}", checksum)
    pipe.expire(ctx.keys.sent_checksums, ctx.store.ttl)
    if segments and all(segment.digest for segment in segments):
        rows = digests_checksum(segment.digest for segment in segments)
        pipe.hset(ctx.keys.sent_rows_checksums, f"{ctx.step}:{rank}", rows)
        pipe.expire(ctx.keys.sent_rows_checksums, ctx.store.ttl)
    pipe.execute()
    # Their work is in the payload now: Redis holds them no longer than that (a redelivered
    # encode builds the rank from the arrays, which stay until the step's release).
    ctx.store.release_sample_wires(ids)
    # The step's sample lines of this rank's rollouts, from what was just read (the one
    # read of them); publish writes the file.
    chosen = choose_samples(len(samples), ctx.manifest.config.samples_per_step, ctx.step)
    held = sorted(set(chosen).intersection(i for plan in plans for i in plan.samples))
    if held:
        held_ids = [samples.labels["rollout_id"][i] for i in held]
        tokens = {rid: arrays[rid] if rid in arrays else wires[rid].token_arrays() for rid in held_ids}
        lines = sample_lines(ctx.step, samples, held, tokens)
        ctx.put(f"{StepValue.SAMPLES}:{rank}", list(zip(held, lines, strict=True)))


# The Celery tasks (prune and pack run in finalize's: `tasks.graph`, carried stages).
__all__ = ["encode", "finalize", "metrics", "prepare", "publish", "release", "send"]
