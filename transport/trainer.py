"""The reference trainer rank: receives each step, checks it, and advances the policy.

It stands in for a real (prime-rl) trainer rank in local runs and tests: it decodes every
payload, checks every invariant of the wire format, reads the side arrays its micro-batches
point at by handle (as prime-rl's ranks `pread` their windows), records checksums of what
it received and read (so tests compare what was sent with what arrived), and once every rank has
received a step it publishes the new policy version that the orchestrator's gate reads.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from transport.base import ReceivedStep, ReplaySource, StepReceiver
from transport.checksum import payload_checksum
from transport.codec import decode_microbatches
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys
from transport.numbering import version_after
from transport.payload_segments import read_side_arrays
from transport.schema import WIRE_559B447, WireProfile
from transport.task_metrics import note_idle

if TYPE_CHECKING:
    from transport.zmq_curve import ClientKeys

log = logging.getLogger("rlship.trainer")

# Record that `rank` trained `step` (and count deliveries and log their order, so a
# duplicate or a step out of order that reached the trainer would show); the rank that
# completes the step raises the policy version to ARGV[5], the version after the step
# (never lowers it, so a replayed step cannot move it back); the rank's contact is noted
# (transport.rank_contact: at ARGV[7], from ARGV[8]). Every key written expires ARGV[6]
# seconds after.
_MARK_TRAINED_LUA = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[5], ARGV[1], 1)
redis.call('RPUSH', KEYS[6], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[7], ARGV[2] .. ':at', ARGV[7], ARGV[2] .. ':heard', ARGV[7],
           ARGV[2] .. ':how', 'acknowledged', ARGV[2] .. ':address', ARGV[8], ARGV[2] .. ':decoded', ARGV[1])
for _, key in ipairs({KEYS[1], KEYS[2], KEYS[5], KEYS[6], KEYS[7]}) do
  redis.call('EXPIRE', key, ARGV[6])
end
if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[4]) then
  local version = tonumber(redis.call('GET', KEYS[3]) or '0')
  local trained = tonumber(ARGV[5])
  if trained > version then
    redis.call('SET', KEYS[3], trained, 'EX', ARGV[6])
    redis.call('PUBLISH', KEYS[4], trained)
  end
  return trained
end
return -1
"""


class Acknowledgements:
    """A rank's acknowledgements in the run's Redis: the sender skips what a rank has, the
    retained payloads of a step every rank has are released, and the rank completing a
    step raises the policy version."""

    def __init__(self, client: redis.Redis, run_id: str, ranks: int, first_step: int) -> None:
        self.client = client
        self.keys = RunKeys(run_id)
        self.ranks = ranks
        self.first_step = first_step
        self._mark_trained = client.register_script(_MARK_TRAINED_LUA)
        self.address = f"{socket.gethostname()} (pid {os.getpid()})"  # where the rank is seen at
        self._foreign_reported = 0

    def report_foreign(self, receiver: StepReceiver) -> None:
        """Put the count of another run's steps the rank dropped in Redis, for the run's
        summary: a rank pointed at the wrong port is noticed there, not only in its log."""
        dropped = receiver.foreign_dropped
        if dropped != self._foreign_reported:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(self.keys.foreign_dropped, str(receiver.rank), dropped)
            pipe.expire(self.keys.foreign_dropped, DEFAULT_TTL_SECONDS)
            pipe.execute()
            self._foreign_reported = dropped

    def record_rows(self, message: ReceivedStep, rows_checksum: str | None) -> None:
        """Put the checksum of the side-array rows the rank read for `message` in Redis,
        before acknowledging it (a step acknowledged has been read whole)."""
        if rows_checksum is not None:
            key = self.keys.received_rows(message.rank)
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(key, message.step, rows_checksum)
            pipe.expire(key, DEFAULT_TTL_SECONDS)
            pipe.execute()

    def acknowledge(self, message: ReceivedStep) -> str:
        """Record that `message` reached its rank; returns the payload's checksum."""
        checksum = payload_checksum(message.payload)
        self._mark_trained(
            keys=[
                self.keys.received(message.rank),
                self.keys.trained(message.step),
                self.keys.policy_version,
                self.keys.policy_channel,
                self.keys.deliveries(message.rank),
                self.keys.delivery_order(message.rank),
                self.keys.rank_contact,
            ],
            args=[
                message.step,
                message.rank,
                checksum,
                self.ranks,
                version_after(message.step, self.first_step),
                DEFAULT_TTL_SECONDS,
                time.time(),
                self.address,
            ],
        )
        return checksum


@dataclass
class TrainerRank:
    """One rank's receive-check-acknowledge loop over any `StepReceiver`."""

    receiver: StepReceiver
    client: redis.Redis
    run_id: str
    ranks: int
    first_step: int
    wire: WireProfile = WIRE_559B447
    received: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.acknowledgements = Acknowledgements(self.client, self.run_id, self.ranks, self.first_step)

    def handle(self, message: ReceivedStep) -> None:
        """Decode and check one step (raises on any violation), then acknowledge it."""
        micro_batches = decode_microbatches(message.payload, self.wire)
        for micro_batch in micro_batches:
            micro_batch.validate()
        self.acknowledgements.record_rows(message, read_side_arrays(micro_batches))
        checksum = self.acknowledgements.acknowledge(message)
        self.received[message.step] = checksum
        tokens = sum(mb.num_tokens for mb in micro_batches)
        log.info(
            "rank %d received step %d: %d micro-batches, %d tokens, checksum %s",
            message.rank,
            message.step,
            len(micro_batches),
            tokens,
            checksum[:12],
        )

    def run(
        self, steps: int | None = None, idle_timeout: float | None = None, stop: threading.Event | None = None
    ) -> None:
        """Receive until `steps` steps have arrived, `idle_timeout` seconds pass without one,
        or `stop` is set (checked between receives: a signal handler sets it, so the signal is
        never raised into a finalizer, where Python would drop it). The time spent waiting in
        `receive` is the rank's idle time (`RunKeys.trainer_idle`), reported before each step
        is handled and every `IDLE_REPORT_SECONDS` while idle."""
        last, rank = time.monotonic(), self.receiver.rank
        idle = IdleTime(self.client, self.run_id, rank)
        try:
            while steps is None or len(self.received) < steps:
                if stop is not None and stop.is_set():
                    log.info("rank %d stops: asked to (SIGTERM)", rank)
                    return
                waited_from = time.monotonic()
                message = self.receiver.receive(timeout=0.5)
                idle.add(time.monotonic() - waited_from, report=message is not None)
                self.acknowledgements.report_foreign(self.receiver)
                if message is None:
                    if idle_timeout is not None and time.monotonic() - last > idle_timeout:
                        log.info("rank %d stops: no step for %g s (its idle timeout)", rank, idle_timeout)
                        return
                    continue
                last = time.monotonic()
                self.handle(message)
        finally:
            idle.report()
        # Said, since a rank given fewer steps than its run's stops early without an error.
        log.info("rank %d stops: the %d steps it was given are received", rank, steps)


IDLE_REPORT_SECONDS = 1.0


class IdleTime:
    """A rank's seconds with no step to take, added up here and put in Redis (one write)
    when a step comes, or once `IDLE_REPORT_SECONDS` have gathered."""

    def __init__(self, client: redis.Redis, run_id: str, rank: int) -> None:
        self.client = client
        self.keys = RunKeys(run_id)
        self.rank = rank
        self.unreported = 0.0

    def add(self, seconds: float, report: bool) -> None:
        self.unreported += seconds
        if report or self.unreported >= IDLE_REPORT_SECONDS:
            self.report()

    def report(self) -> None:
        if self.unreported > 0:
            pipe = self.client.pipeline(transaction=False)
            note_idle(pipe, self.keys, self.rank, self.unreported, DEFAULT_TTL_SECONDS)
            pipe.execute()
            self.unreported = 0.0


def open_receiver(
    transport: str,
    rank: int,
    *,
    run_id: str,
    host: str,
    port: int,
    output_dir: Path,
    next_step: int,
    replay: ReplaySource | None = None,
    curve: ClientKeys | None = None,
    file_mode: str = "owner",
) -> StepReceiver:
    """The rank's receiver for the configured transport (files need no replay: they stay;
    `curve`: the rank's CURVE keys, for ZMQ)."""
    if transport == "zmq":
        from transport.zmq_receiver import ZMQReceiver

        return ZMQReceiver(host, port, rank, run_id=run_id, next_step=next_step, replay=replay, curve=curve)
    if transport == "fs":
        from transport.filesystem import FileReceiver

        return FileReceiver(output_dir, rank, run_id=run_id, next_step=next_step, file_mode=file_mode)
    raise ValueError(f"transport: {transport!r} is not one of 'zmq', 'fs'")
