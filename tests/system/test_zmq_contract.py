"""The ZMQ receiver's edges against real sockets in this process: argument errors, malformed
messages from a raw publisher, and replay of lost steps from a retained-payload source."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

import transport.zmq_sockets as zmq_sockets
from transport.replay import RetainedPayloads
from transport.store import PayloadStore
from transport.zmq_receiver import ZMQReceiver
from transport.zmq_sender import ZMQSender
from transport.zmq_sockets import free_port_pair, parse_topic, poll_ms, topic

HOST = "127.0.0.1"
WAIT = 30.0


class Retained:
    """A `ReplaySource` over payloads held in a dict (what a sender kept for one rank)."""

    def __init__(self, payloads: dict[int, bytes], last_sent: int) -> None:
        self.payloads = payloads
        self.last = last_sent

    def last_sent(self, rank: int) -> int:
        return self.last

    def payload(self, step: int, rank: int) -> bytes | None:
        return self.payloads.get(step)


def test_argument_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"^rank must be >= 0, got -1$"):
        ZMQReceiver(HOST, free_port_pair(), -1, next_step=0, run_id="t")
    with pytest.raises(ValueError, match=r"^announce_interval must be > 0, got 0$"):
        ZMQReceiver(HOST, free_port_pair(), 0, announce_interval=0, next_step=0, run_id="t")
    with pytest.raises(ValueError, match=r"^ranks must be >= 1, got 0$"):
        ZMQSender(HOST, free_port_pair(), 0, run_id="t")
    with (
        ZMQSender(HOST, free_port_pair(), 2, run_id="t") as sender,
        pytest.raises(ValueError, match=r"^rank 2 out of range 0..1$"),
    ):
        sender.send(0, 2, b"x")


def test_a_closed_receiver_says_so() -> None:
    receiver = ZMQReceiver(HOST, free_port_pair(), 0, next_step=0, run_id="t")
    receiver.close()
    receiver.close()
    with pytest.raises(RuntimeError, match=r"^ZMQReceiver is closed$"):
        receiver.receive(0)


def test_poll_ms_never_rounds_a_wait_down_to_zero() -> None:
    assert [poll_ms(s) for s in (0.0, 0.0001, 0.001, 0.0015, 2.0)] == [1, 1, 1, 2, 2000]


def test_topics() -> None:
    assert topic(12, 3, "run-a") == b"data_rank|3|12|run-a"
    assert parse_topic(b"data_rank|3|12|run-a") == (3, 12, "run-a")
    assert parse_topic(b"data_rank|3|12") == (3, 12, None)  # a sender that names no run
    for bad in (b"data_rank|3", b"data_rnk|3|12", b"data_rank|x|1", b"data_rank|1|-1", b"data_rank|1|2|"):
        assert parse_topic(bad) is None, bad


def test_malformed_messages_are_dropped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port_pair()
    ctx = zmq.Context()
    publisher = ctx.socket(zmq.XPUB)
    publisher.bind(f"tcp://{HOST}:{port}")
    caplog.set_level(logging.ERROR, logger="rlship.transport")
    try:
        with ZMQReceiver(HOST, port, 1, next_step=0, run_id="t") as receiver:
            assert publisher.poll(int(WAIT * 1000)) and publisher.recv() == b"\x01data_rank|1|"
            publisher.send_multipart([topic(0, 1, "t")])
            publisher.send_multipart([b"data_rank|1|x", b"payload"])
            publisher.send_multipart([topic(0, 1, "t"), b"a", b"b"])
            publisher.send_multipart([topic(0, 1, "t"), b"good"])
            got = receiver.receive(WAIT)
            assert got is not None and (got.step, got.rank, bytes(got.payload)) == (0, 1, b"good")
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert errors == [
            "rank 1: dropping a message of 1 frames (expected 2)",
            "rank 1: dropping a message with topic b'data_rank|1|x'",
            "rank 1: dropping a message of 3 frames (expected 2)",
        ]
    finally:
        publisher.close(linger=0)
        ctx.term()


def test_steps_the_transport_lost_are_replayed_when_nothing_arrives(caplog: pytest.LogCaptureFixture) -> None:
    """No sender at all: the retained payloads up to the last sent step are the steps."""
    caplog.set_level(logging.WARNING, logger="rlship.transport")
    source = Retained({0: b"zero", 1: b"one", 2: b"two"}, last_sent=1)
    with ZMQReceiver(
        HOST, free_port_pair(), 0, replay=source, replay_after=0.05, next_step=0, run_id="t"
    ) as receiver:
        got = [receiver.receive(WAIT), receiver.receive(WAIT)]
        assert [(g.step, bytes(g.payload)) for g in got if g is not None] == [(0, b"zero"), (1, b"one")]
        assert receiver.receive(0.2) is None, "step 2 was not sent yet"
        assert receiver.replayed == 2 and receiver.next_step == 2
        source.last = 2
        got = receiver.receive(WAIT)
        assert got is not None and (got.step, bytes(got.payload)) == (2, b"two")
        assert receiver.replayed == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"rank 0: step {s} replayed from the retained payloads" for s in (0, 1, 2)]


def test_a_step_no_longer_retained_stops_the_replay(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="rlship.transport")
    with ZMQReceiver(
        HOST,
        free_port_pair(),
        0,
        replay=Retained({0: b"zero"}, 3),
        replay_after=0.05,
        next_step=0,
        run_id="t",
    ) as receiver:
        got = receiver.receive(WAIT)
        assert got is not None and got.step == 0
        assert receiver.receive(0.2) is None and receiver.replayed == 1
    assert "rank 0: step 1 was lost and is no longer retained" in [r.getMessage() for r in caplog.records]


def test_a_later_step_on_the_wire_pulls_the_missing_ones_from_replay() -> None:
    """The source does not know the step was sent (last_sent -1), but holds it."""
    port = free_port_pair()
    source = Retained({0: b"zero", 1: b"one"}, last_sent=-1)
    with (
        ZMQSender(HOST, port, 1, run_id="t") as sender,
        ZMQReceiver(HOST, port, 0, replay=source, replay_after=60, next_step=0, run_id="t") as receiver,
    ):
        assert sender.wait_ready(WAIT)
        sender.send(2, 0, b"two")
        got = [receiver.receive(WAIT) for _ in range(3)]
        assert [(g.step, bytes(g.payload)) for g in got if g is not None] == [
            (0, b"zero"),
            (1, b"one"),
            (2, b"two"),
        ]
        assert receiver.replayed == 2 and receiver.gaps == []


class FakeSocket:
    """A `socket.socket` stand-in for `free_port_pair`: binding one of `taken` raises
    OSError. Every bind is recorded."""

    def __init__(self, taken: set[int], binds: list[tuple[str, int]]) -> None:
        self.taken, self.binds = taken, binds

    def __enter__(self) -> FakeSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def bind(self, address: tuple[str, int]) -> None:
        self.binds.append(address)
        if address[1] in self.taken:
            raise OSError("taken")


def fake_sockets(
    monkeypatch: pytest.MonkeyPatch, candidates: list[int], taken: set[int]
) -> list[tuple[str, int]]:
    binds: list[tuple[str, int]] = []
    monkeypatch.setattr(zmq_sockets, "candidate_ports", lambda: candidates)
    monkeypatch.setattr(zmq_sockets.socket, "socket", lambda: FakeSocket(taken, binds))
    return binds


def test_free_port_pair_skips_a_taken_port_and_a_taken_neighbour(monkeypatch: pytest.MonkeyPatch) -> None:
    binds = fake_sockets(monkeypatch, [5000, 6000, 7000], taken={5000, 6001})
    assert free_port_pair("10.0.0.9") == 7000
    # 5000 taken: its neighbour not tried; 6001 taken: 6000 skipped; 7000 and 7001 free.
    assert binds == [
        ("10.0.0.9", 5000),
        ("10.0.0.9", 6000),
        ("10.0.0.9", 6001),
        ("10.0.0.9", 7000),
        ("10.0.0.9", 7001),
    ]


def test_free_port_pair_gives_up_after_its_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    binds = fake_sockets(monkeypatch, [7000 + 2 * i for i in range(3)], taken={7001, 7003, 7005})
    with pytest.raises(RuntimeError, match=r"^no free port pair on 10\.0\.0\.9$"):
        free_port_pair("10.0.0.9")
    assert binds == [b for i in range(3) for b in (("10.0.0.9", 7000 + 2 * i), ("10.0.0.9", 7001 + 2 * i))]


def test_port_pairs_lie_below_the_ephemeral_range() -> None:
    """A rank that dials a port inside the kernel's ephemeral range before the sender binds
    can be handed that port as its own source port (a TCP self-connect) and hold it."""
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = zmq_sockets.candidate_ports()
    assert len(candidates) == 100 and len(set(candidates)) > 50
    assert all(port >= 20000 and port + 1 < floor for port in candidates)
    ports = [free_port_pair() for _ in range(50)]
    assert all(port >= 20000 and port + 1 < floor for port in ports)


@pytest.mark.timeout(60)
def test_sender_errors_name_the_value_and_defaults_hold() -> None:
    port = free_port_pair()
    with ZMQSender(HOST, port, 3, run_id="t") as sender:
        assert (sender.host, sender.port, sender.ranks, sender.linger_ms) == (HOST, port, 3, 1000)
        assert sender.ready is False and sender.ready_ranks == frozenset()
        assert sender.wait_ready(0) is False
        with pytest.raises(ValueError, match=r"^rank 3 out of range 0\.\.2$"):
            sender.send(0, 3, b"x")
        with pytest.raises(ValueError, match=r"^rank -1 out of range 0\.\.2$"):
            sender.send(0, -1, b"x")
        with pytest.raises(ValueError, match=r"^step must be >= 0, got -1$"):
            sender.send(-1, 0, b"x")
    with pytest.raises(RuntimeError, match=r"^ZMQSender is closed$"):
        sender.send(0, 0, b"x")
    with pytest.raises(RuntimeError, match=r"^ZMQSender is closed$"):
        sender.wait_ready(0)


@pytest.mark.timeout(60)
def test_a_send_to_a_rank_never_ready_times_out_naming_it() -> None:
    # rank 6 of 7: no other test's trainer (ranks 0..3) can answer on a reused port
    with ZMQSender(HOST, free_port_pair(), 7, send_timeout=0.2, run_id="t") as sender:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"^rank 6 step 4: not ready within send_timeout$"):
            sender.send(4, 6, b"x")
        assert time.monotonic() - started < WAIT


class Announcements:
    """An `AnnouncementLog` in memory: what a predecessor recorded, and what this one adds."""

    def __init__(self, earlier: set[int]) -> None:
        self.earlier = earlier
        self.added: list[int] = []
        self.addresses: dict[int, str] = {}

    def load(self) -> set[int]:
        return set(self.earlier)

    def add(self, rank: int) -> None:
        self.added.append(rank)

    def heard(self, rank: int, address: str) -> None:
        self.addresses[rank] = address


def wait_until(condition: Callable[[], bool], sender: ZMQSender) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        sender.wait_ready(0.02, rank=0)
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_ready_announcements_and_subscriptions_by_hand(caplog: pytest.LogCaptureFixture) -> None:
    """Raw PUSH and SUB sockets play the trainers: which READYs count, which are ignored and
    logged, what is recorded for a successor, and the log lines when all ranks are (no
    longer, again) ready."""
    caplog.set_level(logging.INFO, logger="rlship.transport")
    port = free_port_pair()
    ctx = zmq.Context()
    log = Announcements({-1, 0, 2})  # 0 announced to a predecessor; -1 and 2 are not ranks of 2
    endpoint = f"tcp://{HOST}:{port}"

    def sub(prefix: bytes) -> zmq.Socket:
        s = ctx.socket(zmq.SUB)
        s.linger = 0
        s.setsockopt(zmq.SUBSCRIBE, prefix)
        s.connect(endpoint)
        return s

    try:
        with ZMQSender(HOST, port, 2, announcements=log, run_id="t") as sender:
            rank0 = sub(b"data_rank|0|")
            assert sender.wait_ready(WAIT, rank=0), "rank 0 needs only its subscription"
            assert sender.ready_ranks == frozenset({0}) and not sender.ready
            push = ctx.socket(zmq.PUSH)
            push.linger = 0
            push.connect(f"tcp://{HOST}:{port + 1}")
            for ready in (b"ack|0|5", b"2", b"-1", b"y" * 40, b"0", b"1x", b"1|other", b"1|other", b" 1\n"):
                push.send(ready)
            rank1 = sub(b"data_rank|1|")
            assert sender.wait_ready(WAIT)
            assert sender.ready and sender.ready_ranks == frozenset({0, 1})
            assert log.added == [1]
            sender.send(12, 1, b"twelve")
            assert sender.foreign_ready == 2
            assert rank1.poll(int(WAIT * 1000)) and rank1.recv_multipart() == [b"data_rank|1|12|t", b"twelve"]
            assert rank0.poll(0) == 0

            rank1.close()
            wait_until(lambda: 1 not in sender.ready_ranks, sender)
            assert not sender.ready and sender.ready_ranks == frozenset({0})
            anything = sub(b"")  # an empty prefix covers every rank
            assert sender.wait_ready(WAIT)
            assert sender.ready_ranks == frozenset({0, 1}) and log.added == [1]
            anything.close()
            rank0.close()
    finally:
        ctx.destroy(linger=0)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "rlship.transport"]
    ignored = "not a rank in 0..1"
    assert lines == [
        (logging.WARNING, f"ignoring READY b'2': {ignored}"),
        (logging.WARNING, f"ignoring READY b'-1': {ignored}"),
        (logging.WARNING, f"ignoring READY b'{'y' * 32}': {ignored}"),
        (logging.WARNING, f"ignoring READY b'1x': {ignored}"),
        (
            logging.WARNING,
            f"run t: ignoring READY of rank 1 of run other on tcp://{HOST}:{port + 1}: that trainer is "
            "pointed at this run's port",
        ),
        (logging.INFO, f"all 2 ranks ready on tcp://{HOST}:{port}"),
        (logging.WARNING, "ranks [1] lost their subscription; sends wait until they return"),
        (
            logging.WARNING,
            f"run t: rank 0 has 2 subscribers on tcp://{HOST}:{port}: a second trainer receives its steps "
            "(one of another run, pointed at this run's port?)",
        ),
        (logging.INFO, f"all 2 ranks ready on tcp://{HOST}:{port}"),
    ]


@pytest.mark.timeout(60)
def test_the_receiver_subscribes_announces_and_sequences_by_hand() -> None:
    """A raw XPUB and PULL play the sender: the subscription and READY bytes a receiver
    sends, its re-announcements while it waits, and which steps it delivers or drops."""
    port = free_port_pair()
    ctx = zmq.Context()
    publisher = ctx.socket(zmq.XPUB)
    publisher.linger = 0
    publisher.bind(f"tcp://{HOST}:{port}")
    ready = ctx.socket(zmq.PULL)
    ready.linger = 0
    ready.bind(f"tcp://{HOST}:{port + 1}")
    try:
        with ZMQReceiver(HOST, port, 5, next_step=3, run_id="t") as defaults:
            assert (defaults.announce_interval, defaults.replay_after, defaults.replay) == (1.0, 1.0, None)
            assert publisher.poll(int(WAIT * 1000)) and publisher.recv() == b"\x01data_rank|5|"
            assert ready.poll(int(WAIT * 1000)) and ready.recv() == b"5|t"
        with ZMQReceiver(HOST, port, 5, next_step=3, announce_interval=0.05, run_id="t") as receiver:
            assert (receiver.host, receiver.port, receiver.rank, receiver.next_step) == (HOST, port, 5, 3)
            assert (receiver.replayed, receiver.duplicates_dropped, receiver.gaps) == (0, 0, [])
            while publisher.poll(int(WAIT * 1000)):  # the first receiver's unsubscribe may come first
                if publisher.recv() == b"\x01data_rank|5|":
                    break
            announced = 0
            deadline = time.monotonic() + WAIT
            while announced < 3:  # one at construction, then again every 50 ms while receiving
                assert time.monotonic() < deadline, f"only {announced} READYs"
                assert receiver.receive(0.06) is None
                while ready.poll(0):
                    assert ready.recv() == b"5|t"
                    announced += 1
            publisher.send_multipart([b"data_rank|5|3|t", b"three"])
            publisher.send_multipart([b"data_rank|5|2|t", b"two, already delivered before a restart"])
            publisher.send_multipart([b"data_rank|5|3|t", b"three again"])
            publisher.send_multipart([b"data_rank|5|4|other", b"another run's four"])
            publisher.send_multipart([b"data_rank|5|4", b"a four of no run"])
            publisher.send_multipart([b"data_rank|5|5|t", b"five"])
            got = [receiver.receive(WAIT), receiver.receive(WAIT)]
            assert [(g.step, g.rank, bytes(g.payload)) for g in got if g is not None] == [
                (3, 5, b"three"),
                (5, 5, b"five"),
            ]
            assert (receiver.duplicates_dropped, receiver.gaps, receiver.next_step) == (2, [(4, 5)], 6)
            assert (receiver.replayed, receiver.foreign_dropped) == (0, 2)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_replay_from_redis_fills_a_restart_a_gap_and_a_lost_last_step(client, run_id) -> None:
    """The retained payloads in the real Redis: rank 4 restarted at step 1 while the sender
    is at step 3; step 1 and 2 come from Redis, 3 from the wire, 4 (lost in flight, the
    last one sent) from Redis after `replay_after`; step 5 was never sent, so never comes."""
    store = PayloadStore(client, run_id)
    for step in (0, 1, 2, 4, 5):
        store.put_payload(step, 4, b"redis %d" % step)
    client.set(store.keys.last_sent(4), 4)
    port = free_port_pair()
    with (
        ZMQSender(HOST, port, 5, run_id="t") as sender,
        ZMQReceiver(
            HOST,
            port,
            4,
            announce_interval=0.05,
            replay=RetainedPayloads(client, run_id),
            replay_after=0.2,
            next_step=1,
            run_id="t",
        ) as receiver,
    ):
        got = []
        assert sender.wait_ready(WAIT, rank=4)
        sender.send(3, 4, b"wire 3")
        for _ in range(4):
            step = receiver.receive(WAIT)
            assert step is not None, got
            got.append((step.step, step.rank, bytes(step.payload)))
        assert got == [(1, 4, b"redis 1"), (2, 4, b"redis 2"), (3, 4, b"wire 3"), (4, 4, b"redis 4")]
        assert (receiver.replayed, receiver.gaps, receiver.duplicates_dropped, receiver.next_step) == (
            3,
            [],
            0,
            5,
        )


@pytest.mark.timeout(60)
def test_timeouts_wait_their_whole_length() -> None:
    """A wait that times out never returns early (load can only make it longer)."""
    with ZMQSender(HOST, free_port_pair(), 7, run_id="t") as sender:
        started = time.monotonic()
        assert sender.wait_ready(0.4, rank=6) is False
        assert time.monotonic() - started >= 0.4
        started = time.monotonic()
        assert sender.wait_ready(0.3) is False
        assert time.monotonic() - started >= 0.3
    with ZMQReceiver(HOST, free_port_pair(), 6, next_step=0, announce_interval=0.05, run_id="t") as receiver:
        started = time.monotonic()
        assert receiver.receive(0.3) is None
        assert time.monotonic() - started >= 0.3
    # ... and never outlasts its timeout by a whole announce interval (30 s here, so the
    # bound of 15 s leaves any loaded machine room)
    with ZMQReceiver(HOST, free_port_pair(), 6, next_step=0, announce_interval=WAIT, run_id="t") as receiver:
        started = time.monotonic()
        assert receiver.receive(0.2) is None
        assert 0.2 <= time.monotonic() - started < WAIT / 2
