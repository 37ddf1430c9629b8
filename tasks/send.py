"""The send task: one rank's step to its trainer, exactly once and in order per rank, over
the run's transport (ZMQ or files). What makes it exactly-once (the `sending` and
`last_sent` marks around a send) and in order (a step waits until the previous one left
for that rank) is here; the sender itself is `transport.zmq_sender` / `transport.filesystem`.
"""

from __future__ import annotations

import functools
import logging
import socket
import time
from collections.abc import Callable, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from tasks import tracing
from tasks.context import StepContext, redis_client, stage_task
from tasks.manifest import ShipConfig
from transport.base import StepSender
from transport.filesystem import ForeignLayout
from transport.keys import stage_field
from transport.port_claims import other_claimants, port_holder
from transport.rank_contact import SENT, note_contact
from transport.store import PayloadCorruptError, PayloadMissingError
from transport.zmq_curve import MissingKey

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
# A send whose step still has ranks encoding waits this long for the next encode to end
# (`_send_as_encoded`), and stays at most the second figure in all (far below the broker's
# visibility timeout), then leaves the rest to their own tasks.
ENCODE_WAIT_SECONDS = 2.0
STAY_SECONDS = 60.0


@functools.cache
def _sender(run_id: str, config: ShipConfig) -> StepSender:
    """The process's sender for a run's transport; the ZMQ one binds once per process,
    knows every rank that announced READY to an earlier ship worker of the run and, with
    `zmq_curve`, admits only the run's rank keys."""
    if config.transport == "zmq":
        from transport.announcements import RedisAnnouncements
        from transport.zmq_curve import server_keys
        from transport.zmq_sender import ZMQSender

        return ZMQSender(
            config.zmq_host,
            config.zmq_port,
            config.ranks,
            run_id=run_id,
            send_timeout=SEND_TIMEOUT_SECONDS,
            announcements=RedisAnnouncements(redis_client(), run_id),
            curve=server_keys(Path(config.zmq_keys_dir), config.ranks) if config.zmq_curve else None,
        )
    from transport.filesystem import FileSender

    return FileSender(config.output_path, run_id=run_id)


# (run_id, step, rank) whose `sending` mark this process wrote: a retry here is not a crash.
_intents: set[tuple[str, int, int]] = set()


@stage_task("send", computes=False, max_retries=None)
def send(ctx: StepContext, rank: int) -> None:
    """Send one rank its step, once: the step before must have left (per-rank order), and a
    step already marked `last_sent` (it left the process) or acknowledged is not sent again.
    The same task sends the step to every other rank whose payload is ready
    (`_companions`), side by side, each between its own two marks, and then stays for the
    ranks still encoding, sending each as its encode ends (`_send_as_encoded`); their own
    tasks, when they come, find their step sent.

    Exactly-once to a receiver that neither drops duplicates nor replays (prime-rl's)
    rests on two marks around a send that returns only once libzmq has taken the message
    (transport.zmq_sender: its tracker done; all but its last batch are in the kernel's
    socket buffer): `sending` before it, `last_sent` after. A ship worker killed before the
    message left loses it with its libzmq queue; the redelivered task finds `sending`
    above `last_sent` and sends it again, correctly. The one window left: killed after the
    message left and before `last_sent` reached Redis (one Redis round trip; measured in
    docs/reliability.md), the step is delivered and sent again, a duplicate to a stock receiver
    (rlship's receivers drop it). Every such resend is counted in the run's
    `interrupted_sends` hash, field `{step}:{rank}`, so a run reports how often the
    window may have been hit (a ship worker killed between a send's marks and its
    hand-overs counts every rank it was sending to).
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
    """Send the step to `rank`, and to each other rank it can go to now (`_companions`), once
    the sender is bound and the rank has announced READY; retried while either is not so.
    False: the run cannot ship at all (its ports stay held past `bind_wait_seconds`, its
    directory is another run's, its CURVE keys are not there), said in `ship_fatal`
    (`StepContext.stop_run`)."""
    step, run_id, config = ctx.step, ctx.run_id, ctx.manifest.config
    try:
        sender = _sender(run_id, config)
    except ForeignLayout as exc:
        ctx.stop_run(f"the ship worker on {socket.gethostname()} cannot write the steps: {exc}")
        return False
    except MissingKey as exc:
        ctx.stop_run(f"the ship worker on {socket.gethostname()} cannot serve CURVE: {exc}")
        return False
    except zmq.ZMQError as exc:
        problem = _bind_problem(ctx, config, exc)
        waited = time.monotonic() - _unbindable_since.setdefault(run_id, time.monotonic())
        if waited >= config.bind_wait_seconds:
            ctx.stop_run(problem)
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
    companions = _companions(ctx, sender, {rank})
    if rank in _send_ranks(ctx, sender, [rank, *companions.encoded], rank):
        raise ctx.retry(countdown=RETRY_SECONDS, queue=config.ship_queue)
    if companions.encoding:
        _send_as_encoded(ctx, sender, rank)
    return True


def _send_ranks(ctx: StepContext, sender: StepSender, ranks: list[int], own: int | None = None) -> set[int]:
    """Send `ranks` the step side by side, every `sending` mark written first; the ranks
    whose payload did not leave (`_send_side_by_side`; `own`: the task's own rank)."""
    _mark_intents(ctx, ranks)  # every mark before any hand-over: a kill here has sent nothing
    for each in ranks:
        ctx.crash_if_armed("sending", each)  # marked, not sent: the redelivery sends it, once
    return _send_side_by_side(ctx, sender, ranks, own)


@dataclass(frozen=True)
class Companions:
    """The other ranks a send to one rank may send the step to: their step before it left
    (per-rank order), not acknowledged and (ZMQ) the rank ready; `encoded` can go now,
    `encoding` once their encode ends."""

    encoded: list[int]
    encoding: list[int]


def _companions(ctx: StepContext, sender: StepSender, passed: Set[int]) -> Companions:
    """The ranks a send also sends, but `passed` (its own, and any it could not send). Sent
    side by side, their payloads leave together instead of each one after the ship
    process's turn between two tasks; each one's own send task then finds it sent."""
    step, manifest = ctx.step, ctx.manifest
    ready = getattr(sender, "ready_ranks", None)
    others = [r for r in range(manifest.config.ranks) if r not in passed and (ready is None or r in ready)]
    found = Companions([], [])
    if not others:
        return found
    pipe = ctx.client.pipeline(transaction=False)
    for other in others:
        pipe.exists(ctx.keys.done(step, "encode", other))
        pipe.get(ctx.keys.last_sent(other))
        pipe.hexists(ctx.keys.received(other), step)
    replies = pipe.execute()
    for index, other in enumerate(others):
        encoded, last_sent, acknowledged = replies[3 * index : 3 * index + 3]
        left = int(last_sent) if last_sent is not None else -1
        if manifest.prev_step <= left < step and not acknowledged:
            (found.encoded if encoded else found.encoding).append(other)
    return found


def _send_as_encoded(ctx: StepContext, sender: StepSender, rank: int) -> None:
    """Once its own rank has left, the task stays for the step's encodes still running and
    sends each rank as its encode's mark is written (`RunKeys.marked_ranks`), until none is
    left, none ends within `ENCODE_WAIT_SECONDS` or it has stayed `STAY_SECONDS`. The ship
    process's turn between two tasks (Celery's request, task events, the hand-back to the
    pool: 4-10 ms on a busy host) is then paid once a step, not once a rank; the ranks' own
    tasks find them sent. A rank whose payload did not leave is left to its own task."""
    marked = ctx.keys.marked_ranks(ctx.step, "encode")
    passed = {rank}
    until = time.monotonic() + STAY_SECONDS
    while time.monotonic() < until and ctx.client.brpop([marked], timeout=ENCODE_WAIT_SECONDS) is not None:
        # Every mark pushed so far is read below; one pushed after this wakes the next wait.
        ctx.client.unlink(marked)
        companions = _companions(ctx, sender, passed)
        if companions.encoded:
            passed |= _send_ranks(ctx, sender, companions.encoded)
        if not companions.encoding:
            return


def _send_side_by_side(ctx: StepContext, sender: StepSender, ranks: list[int], own: int | None) -> set[int]:
    """Hand every rank's payload over, then mark each `last_sent` once it has left (the
    order handed over). The ranks whose payload did not leave (its trainer not reading)
    are returned: each one's own send task retries it, its message still queued if it is;
    the task's `own` rank's payload missing or corrupt fails the task, as it did alone.

    The `send` fault keeps the window it names: before the kill, every other rank's payload
    leaves and is marked, then the sender's close flushes the socket; only the armed rank's
    step is then sent again (see `send`)."""
    step, name = ctx.step, f"rlship.{ctx.manifest.config.transport}_send"
    started: dict[int, float] = {}  # perf_counter at each rank's hand-over
    not_left: set[int] = set()

    def span(each: int, error: str | None = None) -> float:
        """The rank's send span, from its hand-over to now; its seconds."""
        seconds = time.perf_counter() - started[each]
        tracing.ended_span(name, seconds, error, **{"rlship.step": step, "rlship.rank": each})
        return seconds

    def failed(each: int, exc: Exception) -> None:
        log.warning("step %d rank %d: not sent (%s); its own send task tries again", step, each, exc)
        span(each, str(exc))
        not_left.add(each)

    for each in ranks:
        started[each] = time.perf_counter()
        try:
            sender.hand_over(step, each, ctx.store.get_payload(step, each))
        except TimeoutError as exc:
            failed(each, exc)
        except (PayloadMissingError, PayloadCorruptError) as exc:
            if each == own:
                raise  # first in its task's ranks: nothing handed over yet
            failed(each, exc)
    handed = [each for each in ranks if each not in not_left]

    def left(each: int) -> float | None:
        """Seconds from its hand-over until its payload left; None if it did not."""
        try:
            sender.wait_left(step, each)
        except TimeoutError as exc:
            failed(each, exc)
            return None
        return span(each)

    def mark_the_rest_and_close(rest: list[int]) -> None:
        for other in rest:
            if (seconds := left(other)) is not None:
                _mark_sent(ctx, other, seconds)
        sender.close()

    for index, each in enumerate(handed):
        if (seconds := left(each)) is None:
            continue
        rest = handed[index + 1 :]
        ctx.crash_if_armed("send", each, before=functools.partial(mark_the_rest_and_close, rest))
        _mark_sent(ctx, each, seconds)
    return not_left


def _mark_sent(ctx: StepContext, rank: int, seconds: float) -> None:
    """`last_sent`: the rank's step left the process (see `send`), with its send's seconds.
    The next step is sent only once a replica holds this mark: lost in a failover, it would
    have the step sent again (a duplicate to a stock receiver)."""
    step = ctx.step

    def mark() -> None:
        pipe = ctx.client.pipeline(transaction=True)
        pipe.set(ctx.keys.last_sent(rank), step, ex=ctx.store.ttl)
        pipe.hset(ctx.keys.times(step), stage_field("send", rank), seconds)
        pipe.expire(ctx.keys.times(step), ctx.store.ttl)
        pipe.unlink(ctx.keys.ship_problem)
        note_contact(pipe, ctx.keys, rank, SENT, sent=step)
        pipe.execute()

    ctx.durability.replicate(
        ctx.client, mark, _reads(ctx.keys.last_sent(rank)), f"step {step} rank {rank}'s last_sent mark",
        _at_least(step),
    )  # fmt: skip
    _intents.discard((ctx.run_id, step, rank))


def _reads(*keys: str) -> Callable[[Any], None]:
    def read(pipe: Any) -> None:
        for key in keys:
            pipe.get(key)

    return read


def _at_least(step: int) -> Callable[[list[Any]], bool]:
    """Whether every mark read back (`_reads`) says `step` or later."""
    return lambda found: all(value is not None and int(value) >= step for value in found)


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


def _mark_intents(ctx: StepContext, ranks: list[int]) -> None:
    """Write the `sending` mark of each rank this process has not marked for the step yet,
    in one round trip; where an earlier process wrote it for this step and died before
    `last_sent`, count the resend that follows (see `send`)."""
    step = ctx.step
    fresh = [rank for rank in ranks if (ctx.run_id, step, rank) not in _intents]
    if not fresh:
        return  # this process's own retry: its messages are tracked by the sender
    keys = [ctx.keys.sending(rank) for rank in fresh]

    def write() -> list[Any]:
        pipe = ctx.client.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, step, ex=ctx.store.ttl, get=True)
        return pipe.execute()

    # Sent only once a replica holds the marks: the worker that follows a failover must know.
    previous = ctx.durability.replicate(
        ctx.client, write, _reads(*keys), f"step {step} ranks {fresh}' sending marks", _at_least(step)
    )
    _intents.update((ctx.run_id, step, rank) for rank in fresh)
    resent = [
        rank for rank, mark in zip(fresh, previous, strict=True) if mark is not None and int(mark) == step
    ]
    if not resent:
        return
    pipe = ctx.client.pipeline(transaction=True)
    for rank in resent:
        pipe.hincrby(ctx.keys.interrupted_sends, f"{step}:{rank}", 1)
    pipe.expire(ctx.keys.interrupted_sends, ctx.store.ttl)
    pipe.execute()
    for rank in resent:
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
