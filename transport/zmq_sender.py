"""The sending end of the ZMQ step transport (docs/transports.md, "ZMQ"): one bound
publisher, one SUB per rank (the receiving end: transport/zmq_receiver.py).

An XPUB socket at host:port and a PULL socket at host:port+1. Each message is two
frames, `data_rank|{rank}|{step}|{run_id}` and the payload. Nothing is published to a rank
before it is ready, and "ready" means two things have been seen: the rank's READY
announcement (`{rank}|{run_id}` on the PULL socket; a stock rank's bare rank, which names
no run, is taken too; one naming another run is ignored) and its subscription arriving at
the publisher. The
second is why this is XPUB rather than PUB: a READY can overtake the subscription, and a
PUB would silently drop whatever it publishes in between (the "slow joiner"). Readiness is
per rank, never all ranks at once: a replacement sender (a ship worker started again) must
reach the ranks still waiting even when another rank has finished and left. prime-rl's
stock receivers announce READY once, when they start; with an `AnnouncementLog` the
sender keeps every announcement (in Redis) so that a replacement knows the ranks that
announced to its predecessor, and needs only their subscriptions (a SUB reconnects by
itself, and libzmq resends its subscriptions once the application next calls into the
socket: a trainer blocked in `recv` or `poll` does; one that never touches it does not).

The publisher counts subscribers per rank (`XPUB_VERBOSER` reports every subscription and
every unsubscription, a disconnect included): a rank with two subscribers has a second
trainer on its steps, most likely one of another run pointed at this run's port, and the
sender says so once in its log. A stock receiver names no run, so this is how its
mix-up is noticed.

`send` (`hand_over`, then `wait_left`) returns once the message has left the process:
libzmq queues a message and its I/O thread writes it to the TCP socket later, and a process
that dies (SIGKILL) loses whatever is still queued. Each message is tracked (zero-copy,
`copy_threshold` 0, so the tracker follows the real buffer) and `wait_left` waits until
libzmq has released it, i.e.
written it to the kernel's socket buffer (the last <= 8 KiB of it may sit in libzmq's
output batch while the kernel buffer is full), which the kernel delivers even if the
process dies next. A caller that marks a step sent once it has left (tasks/send.py's
`last_sent`) marks only what has left.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Protocol

import zmq

from transport.base import Closeable, Payload
from transport.zmq_curve import ServerKeys, serve, start_authenticator
from transport.zmq_sockets import endpoint, parse_ready, poll_ms, rank_prefix, topic

logger = logging.getLogger("rlship.transport")
LEAVING_POLL_SECONDS = 0.1  # how often a send waiting for its message to leave looks at the rank


class AnnouncementLog(Protocol):
    """Where a sender keeps the ranks that announced READY, so the announcement outlives it."""

    def load(self) -> set[int]: ...

    def add(self, rank: int) -> None: ...

    def heard(self, rank: int, address: str) -> None: ...


class ZMQSender(Closeable):
    """Publishes each (step, rank) payload to that rank's subscriber, after all ranks are ready.

    The publisher sets XPUB_NODROP: when a rank's queue holds `hwm` messages, `send` blocks
    (backpressure from a slow trainer) instead of silently dropping a training step as a
    plain PUB would. `send_timeout` bounds each wait of `send`, for readiness and for queue
    space (TimeoutError); None waits forever.
    A rank whose subscription disappears (its trainer disconnected) is not ready again
    until it resubscribes, so `send` waits rather than publish into the void.
    `announcements` carries READY announcements across senders (module docstring).
    `foreign_ready` counts the READYs of other runs' ranks this sender ignored.
    With `curve` both sockets are CURVE servers admitting only the run's rank keys
    (transport/zmq_curve.py): a peer without one neither subscribes nor announces READY.
    """

    def __init__(
        self,
        host: str,
        port: int,
        ranks: int,
        *,
        run_id: str,
        hwm: int = 64,
        linger_ms: int = 1000,
        send_timeout: float | None = None,
        announcements: AnnouncementLog | None = None,
        curve: ServerKeys | None = None,
    ) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.host = host
        self.port = port
        self.ranks = ranks
        self.run_id = run_id
        self.foreign_ready = 0
        self._foreign_runs_logged: set[str] = set()
        self.linger_ms = linger_ms
        self._send_timeout = send_timeout
        self._announcements = announcements
        self._announced: set[int] = (
            {r for r in announcements.load() if 0 <= r < ranks} if announcements is not None else set()
        )
        # Messages handed to libzmq that have not left the process yet, by (step, rank).
        self._leaving: dict[tuple[int, int], zmq.MessageTracker] = {}
        self._subscribers: Counter[bytes] = Counter()  # topic -> subscribers holding it
        self._subscribed: set[int] = set()
        self._crowded_logged: dict[int, int] = {}  # rank -> subscriber count last warned of
        self._ready = False
        self._closed = False
        self._ctx = zmq.Context()
        self._authenticator = None
        try:
            if curve is not None:
                where = f"run {run_id} on {endpoint(host, port)} and {port + 1}"
                self._authenticator = start_authenticator(self._ctx, curve, where)
            self._pub = self._ctx.socket(zmq.XPUB)
            if curve is not None:
                serve(self._pub, curve)
            self._pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription (docstring)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, linger_ms)
            self._pub.copy_threshold = 0  # track every payload, however small (module docstring)
            if send_timeout is not None:
                self._pub.setsockopt(zmq.SNDTIMEO, poll_ms(send_timeout))
            self._pub.bind(endpoint(host, port))
            self._pull = self._ctx.socket(zmq.PULL)
            if curve is not None:
                serve(self._pull, curve)
            self._pull.setsockopt(zmq.LINGER, 0)
            self._pull.bind(endpoint(host, port + 1))
        except BaseException:
            self._stop_authenticator()
            self._ctx.destroy(linger=0)
            self._closed = True
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._pub, zmq.POLLIN)
        self._poller.register(self._pull, zmq.POLLIN)

    @property
    def ready_ranks(self) -> frozenset[int]:
        """Ranks that have both announced READY and are currently subscribed."""
        return frozenset(self._announced & self._subscribed)

    @property
    def ready(self) -> bool:
        return self._ready

    def wait_ready(self, timeout: float | None = None, rank: int | None = None) -> bool:
        """Block until `rank` (every rank, if None) is ready; False if `timeout` seconds
        pass first. A message published to a rank with no subscriber would be lost, but
        another rank's absence must not hold it back."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._drain()
            if self._ready if rank is None else rank in self.ready_ranks:
                return True
            wait = 1.0
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                wait = min(wait, remaining)
            self._poller.poll(poll_ms(wait))

    def send(self, step: int, rank: int, payload: Payload) -> None:
        """Publish one rank's payload for `step` without copying it; return once it has left
        the process (module docstring): `hand_over`, then `wait_left`."""
        self.hand_over(step, rank, payload)
        self.wait_left(step, rank)

    def hand_over(self, step: int, rank: int, payload: Payload) -> None:
        """Queue one rank's payload for `step` in libzmq, tracked, and return at once: the
        payloads of several ranks handed over in turn leave side by side, each rank reading
        its own, and `wait_left` waits for each.

        The buffer is handed to libzmq as is: do not mutate a bytearray/memoryview after
        passing it in. Blocks until this rank is ready and while its queue is full, each
        wait bounded by `send_timeout` (TimeoutError). A (step, rank) handed over that has
        not left (a `wait_left` timed out) is not queued again: its message is still there.
        """
        self._check_open()
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} out of range 0..{self.ranks - 1}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if (step, rank) in self._leaving:
            return
        if not self.wait_ready(self._send_timeout, rank=rank):
            raise TimeoutError(f"rank {rank} step {step}: not ready within send_timeout")
        try:
            frames = [topic(step, rank, self.run_id), payload]
            tracker = self._pub.send_multipart(frames, copy=False, track=True)
        except zmq.Again as exc:
            raise TimeoutError(f"rank {rank} step {step}: send queue full past send_timeout") from exc
        self._leaving[(step, rank)] = tracker

    def wait_left(self, step: int, rank: int) -> None:
        """Return once the payload handed over for (step, rank) has left the process (module
        docstring); the wait is bounded by `send_timeout` (TimeoutError, the message still
        queued), and ends at once if the rank leaves with it queued (TimeoutError, the
        message gone with the rank's connection: hand it over again)."""
        tracker = self._leaving.get((step, rank))
        if tracker is None:
            raise ValueError(f"rank {rank} step {step}: nothing handed over to wait for")
        deadline = None if self._send_timeout is None else time.monotonic() + self._send_timeout
        while True:
            try:
                tracker.wait(LEAVING_POLL_SECONDS)
                break
            except zmq.NotDone:
                pass
            self._drain()
            if rank not in self.ready_ranks:
                # Queued on the connection of a rank that left (libzmq notices a dead peer at
                # the next send to it): that message goes with the connection; a later send
                # to the rank's new one is its only copy. The process stays free meanwhile.
                del self._leaving[(step, rank)]
                raise TimeoutError(f"rank {rank} step {step}: the rank left with the message queued")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"rank {rank} step {step}: still queued in libzmq past send_timeout")
        del self._leaving[(step, rank)]

    def close(self) -> None:
        """Close both sockets; pending messages get at most `linger_ms` to leave."""
        if self._closed:
            return
        self._closed = True
        self._pub.close(linger=self.linger_ms)
        self._pull.close(linger=0)
        self._stop_authenticator()
        self._ctx.term()

    def _stop_authenticator(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ZMQSender is closed")

    def _drain(self) -> None:
        """Consume all pending control messages without blocking."""
        changed = False
        for sock, handle in ((self._pub, self._on_subscription), (self._pull, self._on_announce)):
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                changed |= handle(frame)
        if changed:
            self._update_ready()

    def subscribers(self, rank: int) -> int:
        """Subscribers whose subscription covers `rank`: every message of that rank matches
        it (a prefix of the rank prefix, e.g. b"" or b"data_rank|3|")."""
        return sum(n for t, n in self._subscribers.items() if rank_prefix(rank).startswith(t))

    def _on_subscription(self, frame: zmq.Frame) -> bool:
        msg = frame.bytes
        if not msg or msg[0] not in (0, 1):
            return False
        sub_topic = bytes(msg[1:])
        self._subscribers[sub_topic] += 1 if msg[0] == 1 else -1
        self._subscribers = +self._subscribers  # drop topics no subscriber holds
        counts = {r: self.subscribers(r) for r in range(self.ranks)}
        self._subscribed = {r for r, n in counts.items() if n}
        for rank, count in counts.items():
            if count > max(1, self._crowded_logged.get(rank, 1)):
                logger.warning(
                    "run %s: rank %d has %d subscribers on %s: a second trainer receives its "
                    "steps (one of another run, pointed at this run's port?)",
                    self.run_id, rank, count, endpoint(self.host, self.port),
                )  # fmt: skip
            self._crowded_logged[rank] = count
        return True

    def _on_announce(self, frame: zmq.Frame) -> bool:
        msg = frame.bytes
        if msg.strip().startswith(b"ack|"):
            return False  # prime-rl's per-step consumption ack: nothing to do with readiness
        ready = parse_ready(msg)
        if ready is None or ready[0] >= self.ranks:
            logger.warning("ignoring READY %r: not a rank in 0..%d", msg[:32], self.ranks - 1)
            return False
        rank, run_id = ready
        if run_id is not None and run_id != self.run_id:
            self.foreign_ready += 1
            if run_id not in self._foreign_runs_logged:
                self._foreign_runs_logged.add(run_id)
                logger.warning(
                    "run %s: ignoring READY of rank %d of run %s on %s: that trainer is pointed "
                    "at this run's port",
                    self.run_id, rank, run_id, endpoint(self.host, self.port + 1),
                )  # fmt: skip
            return False
        if self._announcements is not None:
            self._announcements.heard(rank, frame.get("Peer-Address"))
        if rank in self._announced:
            return False
        self._announced.add(rank)
        if self._announcements is not None:
            self._announcements.add(rank)
        return True

    def _update_ready(self) -> None:
        ready = self.ready_ranks
        was_ready = self._ready
        self._ready = len(ready) == self.ranks
        if self._ready and not was_ready:
            logger.info("all %d ranks ready on %s", self.ranks, endpoint(self.host, self.port))
        elif was_ready and not self._ready:
            missing = sorted(set(range(self.ranks)) - ready)
            logger.warning("ranks %s lost their subscription; sends wait until they return", missing)
