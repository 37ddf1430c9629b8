"""The ship path's stage tasks: each body is its stage, loading inputs from Redis, calling
a stage function (`tasks.stages`) and storing its output. What every task does around
that (context, skips, timing and marks, successors) is `tasks.context.stage_task`; which
stage follows which is `tasks.graph`.

The record is written in one transaction guarded by the `published` hash; per rank,
`send` waits until the previous step reached that rank.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import msgpack
import redis
import zmq

from tasks.app import app
from tasks.cohort import Cohort
from tasks.context import StepContext, redis_client, stage_task
from tasks.manifest import ShipConfig
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
from tasks.stages.publish import build_record, running_totals
from tasks.stages.release import trim_process_memory
from tasks.stages.samples import choose_samples, sample_lines, write_samples
from transport.base import StepSender
from transport.checksum import payload_checksum
from transport.filesystem import ForeignLayout
from transport.keys import StepValue, stage_field, stage_of_field
from transport.outcomes import cut_into, dropped_at, record_outcomes
from transport.payload_dir import PayloadDirectory
from transport.payload_segments import PAYLOAD_FIELD, RunRows, digests_checksum
from transport.port_claims import other_claimants, port_holder
from transport.store import DEFAULT_TTL_SECONDS, PayloadMissingError, PayloadStore

log = logging.getLogger("rlship.tasks")

RETRY_SECONDS = 0.05
# A send waiting for its rank's previous step retries after 0.05, 0.1, 0.2, ... s, at most
# this long: a short wait (the previous step's encode finishing late) still ends within
# tens of ms, and a rank held for minutes costs one retry a second, not twenty.
SEND_WAIT_MAX_SECONDS = 1.0
READY_WAIT_SECONDS = 1.0
BIND_RETRY_SECONDS = 1.0  # a port held by another process, within the run's bind_wait_seconds
SHIP_PROBLEM_SECONDS = 10
# A trainer whose queue stays full this long makes the send fail and retry later, so a
# stuck rank holds back its own step instead of blocking the ship worker forever.
SEND_TIMEOUT_SECONDS = 30.0
# Records kept in the Redis stream (followers read them within seconds; metrics.jsonl and
# W&B keep them all): a run of any length holds a bounded history in Redis.
RECORDS_KEPT = 1000


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


@stage_task("metrics")
def metrics(ctx: StepContext) -> None:
    shipped = Cohort.from_wire(ctx.get(StepValue.PRUNED)["samples"])
    dropped = list(ctx.get(StepValue.DROPPED).values())
    ctx.put(StepValue.METRICS, step_metrics(ctx.manifest, shipped, dropped))


@stage_task("pack")
def pack(ctx: StepContext) -> None:
    config = ctx.manifest.config
    samples = Cohort.from_wire(ctx.get(StepValue.PRUNED)["samples"])
    plan = pack_samples(samples.numeric["num_tokens"], config.ranks, config.seq_len, config.pad_to_multiple)
    ctx.put(StepValue.PLAN, plan.to_wire())


@stage_task("encode")
def encode(ctx: StepContext, rank: int) -> None:
    """The rank's payload, joined from its samples' wire parts made before the cut
    (`prepare`); a sample without them has its arrays read and its parts made here, and a
    rank holding a sample of optional streams is built from the arrays."""
    plans = PackPlan.from_wire(ctx.get(StepValue.PLAN)).ranks[rank]
    samples = Cohort.from_wire(ctx.get(StepValue.PRUNED)["samples"])
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


@functools.cache
def _sender(run_id: str, config: ShipConfig) -> StepSender:
    """The process's sender for a run's transport; the ZMQ one binds once per process and
    knows every rank that announced READY to an earlier ship worker of the run."""
    if config.transport == "zmq":
        from transport.announcements import RedisAnnouncements
        from transport.zmq_sender import ZMQSender

        return ZMQSender(
            config.zmq_host,
            config.zmq_port,
            config.ranks,
            run_id=run_id,
            send_timeout=SEND_TIMEOUT_SECONDS,
            announcements=RedisAnnouncements(redis_client(), run_id),
        )
    from transport.filesystem import FileSender

    return FileSender(config.output_path, run_id=run_id)


# (run_id, step, rank) whose `sending` mark this process wrote: a retry here is not a crash.
_intents: set[tuple[str, int, int]] = set()


@stage_task("send", computes=False, max_retries=None)
def send(ctx: StepContext, rank: int) -> None:
    """Send one rank its step, once: the step before must have left (per-rank order), and a
    step already marked `last_sent` (it left the process) or acknowledged is not sent again.

    Exactly-once to a receiver that neither drops duplicates nor replays (prime-rl's)
    rests on two marks around a send that returns only once the message has left the
    process (transport.zmq_sender: in the kernel's socket buffer, delivered even if this
    process dies next): `sending` before it, `last_sent` after. A ship worker killed before
    the message left loses it with its libzmq queue; the redelivered task finds `sending`
    above `last_sent` and sends it again, correctly. The one window left: killed after the
    message left and before `last_sent` reached Redis (one Redis round trip; measured in
    docs/reliability.md), the step is delivered and sent again, a duplicate to a stock receiver
    (rlship's receivers drop it). Every such resend is counted in the run's
    `interrupted_sends` hash, field `{step}:{rank}`, so a run reports how often the
    window may have been hit.
    """
    step = ctx.step
    manifest = ctx.manifest
    last_sent_raw = ctx.client.get(ctx.keys.last_sent(rank))
    last_sent = int(last_sent_raw) if last_sent_raw is not None else -1
    if last_sent < manifest.prev_step:
        # Backing off, not blocking: the single ship process must stay free to send the
        # step this one waits for (and every other rank's steps) meanwhile.
        wait = min(RETRY_SECONDS * 2 ** min(ctx.retries, 10), SEND_WAIT_MAX_SECONDS)
        raise ctx.retry(countdown=wait, queue=manifest.config.ship_queue)
    if last_sent < step and ctx.client.hexists(ctx.keys.received(rank), step):
        # The rank acknowledged it (a send that died before marking it): a trainer that has
        # its last step may have left, and must not be waited for.
        log.info("step %d rank %d: acknowledged by the rank already; not sent again", step, rank)
        ctx.client.set(ctx.keys.last_sent(rank), step, ex=ctx.store.ttl)
    elif last_sent < step and not _send_now(ctx, rank):
        return  # the run cannot ship: its orchestrator stops it
    sent_key = ctx.keys.sent(step)
    pipe = ctx.client.pipeline(transaction=True)
    pipe.sadd(sent_key, rank)
    pipe.expire(sent_key, ctx.store.ttl)
    pipe.sadd(ctx.keys.step_keys(step), sent_key)
    pipe.execute()


def _send_now(ctx: StepContext, rank: int) -> bool:
    """Send the step to `rank` between the two marks (see `send`), once the sender is bound
    and the rank has announced READY; retried while either is not so. False: the run cannot
    ship at all (its ports stay held past `bind_wait_seconds`, its directory is another
    run's), said in `ship_fatal`."""
    step, run_id, config = ctx.step, ctx.run_id, ctx.manifest.config
    try:
        sender = _sender(run_id, config)
    except ForeignLayout as exc:
        _stop_run(ctx, f"the ship worker on {socket.gethostname()} cannot write the steps: {exc}")
        return False
    except zmq.ZMQError as exc:
        problem = _bind_problem(ctx, config, exc)
        waited = time.monotonic() - _unbindable_since.setdefault(run_id, time.monotonic())
        if waited >= config.bind_wait_seconds:
            _stop_run(ctx, problem)
            return False
        _report_ship_problem(
            ctx, f"{problem}; waiting up to {config.bind_wait_seconds:.0f} s (bind_wait_seconds)"
        )
        raise ctx.retry(countdown=BIND_RETRY_SECONDS, queue=config.ship_queue) from None
    _unbindable_since.pop(run_id, None)
    wait_ready = getattr(sender, "wait_ready", None)
    if wait_ready is not None and not wait_ready(timeout=READY_WAIT_SECONDS, rank=rank):
        log.info("step %d rank %d: waiting for trainer ranks to announce READY", step, rank)
        _report_ship_problem(
            ctx,
            f"trainer rank {rank} has not announced READY to {config.zmq_host}:{config.zmq_port + 1} "
            "(not started, or pointed at another host or port?)",
        )
        raise ctx.retry(countdown=RETRY_SECONDS, queue=config.ship_queue)
    _mark_intent(ctx, step, rank)
    ctx.crash_if_armed("sending", rank)  # marked, not sent: the redelivery sends it, once
    started = time.perf_counter()
    try:
        sender.send(step, rank, ctx.store.get_payload(step, rank))
    except TimeoutError:
        log.warning("step %d rank %d: trainer not reading; retrying", step, rank)
        raise ctx.retry(countdown=RETRY_SECONDS, queue=config.ship_queue) from None
    seconds = time.perf_counter() - started
    ctx.crash_if_armed("send", rank)  # left the process, not yet marked: the window

    def mark_sent() -> None:
        pipe = ctx.client.pipeline(transaction=True)
        pipe.set(ctx.keys.last_sent(rank), step, ex=ctx.store.ttl)
        pipe.hset(ctx.keys.times(step), stage_field("send", rank), seconds)
        pipe.expire(ctx.keys.times(step), ctx.store.ttl)
        pipe.unlink(ctx.keys.ship_problem)
        pipe.execute()

    # The next step is sent only once a replica holds this mark: lost in a failover, it would
    # have the step sent again (a duplicate to a stock receiver).
    ctx.durability.replicate(
        ctx.client, mark_sent, _reads(ctx.keys.last_sent(rank)), f"step {step} rank {rank}'s last_sent mark",
        _at_least(step),
    )  # fmt: skip
    _intents.discard((run_id, step, rank))
    return True


def _reads(key: str) -> Callable[[Any], None]:
    return lambda pipe: pipe.get(key)


def _at_least(step: int) -> Callable[[list[Any]], bool]:
    """Whether a mark read back (`_reads`) says `step` or later."""
    return lambda found: found[0] is not None and int(found[0]) >= step


# Per run, since when this process has failed to bind the run's ports (bind_wait_seconds).
_unbindable_since: dict[str, float] = {}


def _bind_problem(ctx: StepContext, config: ShipConfig, exc: zmq.ZMQError) -> str:
    """The one line that says which address cannot be bound and who holds it: the process
    listening there, and another run claiming the ports in Redis."""
    holders = [
        f"{port}: {holder}"
        for port in (config.zmq_port, config.zmq_port + 1)
        if (holder := port_holder(port))
    ]
    held = f"; held by {', '.join(holders)}" if holders else ""
    claimants = other_claimants(ctx.client, ctx.run_id, config.zmq_host, config.zmq_port)
    claimed = f"; claimed by live run {', '.join(claimants)}" if claimants else ""
    return (
        f"the ship worker on {socket.gethostname()} cannot bind {config.zmq_host}:{config.zmq_port} "
        f"and the READY port {config.zmq_port + 1}: {exc}{held}{claimed}"
    )


def _stop_run(ctx: StepContext, problem: str) -> None:
    """The run cannot ship: say why where its orchestrator looks every second (it stops the
    run naming it); this send ends without a retry."""
    log.error("step %d: %s; the run stops", ctx.step, problem)
    ctx.client.set(ctx.keys.ship_fatal, problem, ex=DEFAULT_TTL_SECONDS)


def _mark_intent(ctx: StepContext, step: int, rank: int) -> None:
    """Write the `sending` mark; if an earlier process wrote it for this step and died
    before `last_sent`, count the resend that follows (see `send`)."""
    intent = (ctx.run_id, step, rank)
    if intent in _intents:
        return  # this process's own retry: its message is tracked by the sender
    sending = ctx.keys.sending(rank)
    # Sent only once a replica holds the mark: the worker that follows a failover must know.
    previous = ctx.durability.replicate(
        ctx.client,
        lambda: ctx.client.set(sending, step, ex=ctx.store.ttl, get=True),
        _reads(sending),
        f"step {step} rank {rank}'s sending mark",
        _at_least(step),
    )
    _intents.add(intent)
    if previous is not None and int(previous) == step:
        pipe = ctx.client.pipeline(transaction=True)
        pipe.hincrby(ctx.keys.interrupted_sends, f"{step}:{rank}", 1)
        pipe.expire(ctx.keys.interrupted_sends, ctx.store.ttl)
        pipe.execute()
        log.warning(
            "step %d rank %d: the previous send died before marking it sent; sending again "
            "(a receiver without duplicate checks gets it twice only if that process died "
            "after the message left it)",
            step,
            rank,
        )


def _report_ship_problem(ctx: StepContext, problem: str) -> None:
    """Say why sends do not go out, for the orchestrator's diagnosis of a stuck step."""
    log.info("step %d: %s", ctx.step, problem)
    ctx.client.set(ctx.keys.ship_problem, problem, ex=SHIP_PROBLEM_SECONDS)


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
    step, manifest, keys = ctx.step, ctx.manifest, ctx.keys
    if manifest.prev_step >= 0 and not ctx.is_published(manifest.prev_step):
        raise ctx.retry(countdown=RETRY_SECONDS, queue=manifest.config.cpu_queue)
    _write_step_samples(ctx)
    # The step counts as published (the orchestrator goes on, sinks get the record) once a
    # replica holds the record: lost in a failover, it is written again, once.
    ctx.durability.replicate(
        ctx.client,
        lambda: _write_record(ctx),
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


def _write_record(ctx: StepContext) -> None:
    """The record and the `published` mark, in one transaction guarded by that mark."""
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
                    step, step_record, stage_seconds, ship_seconds, manifest.policy_wait, totals
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
                for written in (keys.metrics_stream, keys.published, keys.totals):
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
    ctx.count_served(pipe)
    if pipe.execute()[0]:
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
    step = ctx.step
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
    ctx.count_call("release", pipe)
    pipe.execute()
    log.info("step %d released: %d keys deleted, payloads of %d steps", step, deleted, payloads.steps)
