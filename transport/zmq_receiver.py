"""The receiving end of the ZMQ step transport (docs/transports.md, "ZMQ"), one per trainer
rank (the sending end: transport/zmq_sender.py).

A SUB socket subscribed to `data_rank|{rank}|` and a PUSH socket to port+1. It
re-announces READY (`{rank}|{run_id}`) while it waits, so a sender that restarted and bound
again (a replacement ship worker) learns about it without the trainer restarting. It takes
only its own run's steps: a message whose topic names another run (or none: a sender of
no rlship run) is dropped, counted in `foreign_dropped` and logged once per sender run,
naming both runs: a rank pointed at another run's port must not train that run's steps. PUB/SUB cannot
replay, so with a `ReplaySource` the receiver fills what the socket lost from the sender's
retained payloads: the steps before the first one it sees (a restarted rank), a gap
(a message lost in flight), and a step the sender reports sent that has not arrived after
`replay_after` seconds (the last step of a run lost in flight).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque

import zmq

from transport.base import ReceivedStep, ReplaySource, SequencedReceiver, StepSequencer
from transport.zmq_curve import ClientKeys, connect_as_client
from transport.zmq_sockets import endpoint, parse_topic, poll_ms, rank_prefix, ready_message

logger = logging.getLogger("rlship.transport")


class ZMQReceiver(SequencedReceiver):
    """One trainer rank's receiving end; delivers each step once, in order (StepSequencer).

    Payloads are returned as memoryviews of the received frame (no copy); the frame stays
    alive as long as the memoryview does, also after `close()`. With `curve` both sockets
    connect as CURVE clients with the rank's key pair (transport/zmq_curve.py).
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        *,
        run_id: str,
        next_step: int,
        hwm: int = 64,
        announce_interval: float = 1.0,
        replay: ReplaySource | None = None,
        replay_after: float = 1.0,
        curve: ClientKeys | None = None,
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if announce_interval <= 0:
            raise ValueError(f"announce_interval must be > 0, got {announce_interval}")
        self.host = host
        self.port = port
        self.announce_interval = announce_interval
        self.replay = replay
        self.replay_after = replay_after
        self.replayed = 0
        self.run_id = run_id
        self.foreign_dropped = 0
        self._foreign_runs_logged: set[str | None] = set()
        self._ready: deque[ReceivedStep] = deque()
        self._last_arrival = -math.inf  # a restarted rank catches up at its first receive
        self._sequencer = StepSequencer(rank, next_step)
        self._ready_msg = ready_message(rank, run_id)
        self._closed = False
        self._ctx = zmq.Context()
        try:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.RCVHWM, hwm)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, rank_prefix(rank))
            if curve is not None:
                connect_as_client(self._sub, curve)
            self._sub.connect(endpoint(host, port))
            # READY is idempotent and repeated, so it must never make the trainer wait:
            # a tiny queue, non-blocking sends, nothing kept at close.
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.SNDHWM, 1)
            self._push.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                connect_as_client(self._push, curve)
            self._push.connect(endpoint(host, port + 1))
        except BaseException:
            self._ctx.destroy(linger=0)
            self._closed = True
            raise
        self._last_announce = -math.inf
        self._announce()

    def receive(self, timeout: float | None = None) -> ReceivedStep | None:
        """The next deliverable step, or None after `timeout` seconds (None: wait forever)."""
        if self._closed:
            raise RuntimeError("ZMQReceiver is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._ready:
                return self._ready.popleft()
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                frames = None
            if frames is not None:
                self._accept(frames)
                continue
            now = time.monotonic()
            if self.replay is not None and now - self._last_arrival >= self.replay_after:
                self._last_arrival = now
                self._replay_through(self.replay.last_sent(self.rank))
                if self._ready:
                    continue
            if deadline is not None and now >= deadline:
                return None
            if now >= self._last_announce + self.announce_interval:
                self._announce()
            wait = self._last_announce + self.announce_interval - now
            if deadline is not None:
                wait = min(wait, deadline - now)
            self._sub.poll(poll_ms(wait), zmq.POLLIN)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sub.close(linger=0)
        self._push.close(linger=0)
        self._ctx.term()

    def _announce(self) -> None:
        self._last_announce = time.monotonic()
        # Again: a READY is still queued (the sender is not up yet); that one will do.
        with contextlib.suppress(zmq.Again):
            self._push.send(self._ready_msg, zmq.NOBLOCK)

    def _accept(self, frames: list[zmq.Frame]) -> None:
        """Queue a received message for delivery, after any lost steps before it."""
        if len(frames) != 2:
            logger.error("rank %d: dropping a message of %d frames (expected 2)", self.rank, len(frames))
            return
        parsed = parse_topic(frames[0].bytes)
        if parsed is None or parsed.rank != self.rank:
            logger.error("rank %d: dropping a message with topic %r", self.rank, frames[0].bytes[:64])
            return
        if parsed.run_id != self.run_id:
            self._drop_foreign(parsed.run_id, parsed.step)
            return
        step = parsed.step
        self._last_arrival = time.monotonic()
        if self.replay is not None and step > self.next_step:
            self._replay_through(step - 1)
        if self._sequencer.admit(step):
            self._ready.append(ReceivedStep(step=step, rank=self.rank, payload=frames[1].buffer))

    def _drop_foreign(self, run_id: str | None, step: int) -> None:
        self.foreign_dropped += 1
        if run_id in self._foreign_runs_logged:
            return
        self._foreign_runs_logged.add(run_id)
        sender = f"run {run_id}" if run_id is not None else "a sender that names no run"
        logger.error(
            "rank %d of run %s: dropping step %d of %s from %s: this rank is pointed at another "
            "run's port; it trains nothing from it (further drops counted, not logged)",
            self.rank, self.run_id, step, sender, endpoint(self.host, self.port),
        )  # fmt: skip

    def _replay_through(self, last: int) -> None:
        """Queue steps next_step..last from the replay source, stopping at the first one it
        no longer holds (the sequencer then reports the gap)."""
        assert self.replay is not None
        while self.next_step <= last:
            step = self.next_step
            payload = self.replay.payload(step, self.rank)
            if payload is None:
                logger.error("rank %d: step %d was lost and is no longer retained", self.rank, step)
                return
            self._sequencer.admit(step)
            self._ready.append(ReceivedStep(step=step, rank=self.rank, payload=payload))
            self.replayed += 1
            logger.warning("rank %d: step %d replayed from the retained payloads", self.rank, step)
