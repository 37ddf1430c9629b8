"""The ZMQ receiver's edges against real sockets in this process: argument errors, malformed
messages from a raw publisher, and replay of lost steps from a retained-payload source."""

from __future__ import annotations

import logging

import pytest
import zmq

from transport.zmq import ZMQReceiver, ZMQSender, _poll_ms, free_port_pair, parse_topic, topic

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
        ZMQReceiver(HOST, free_port_pair(), -1, next_step=0)
    with pytest.raises(ValueError, match=r"^announce_interval must be > 0, got 0$"):
        ZMQReceiver(HOST, free_port_pair(), 0, announce_interval=0, next_step=0)
    with pytest.raises(ValueError, match=r"^ranks must be >= 1, got 0$"):
        ZMQSender(HOST, free_port_pair(), 0)
    with (
        ZMQSender(HOST, free_port_pair(), 2) as sender,
        pytest.raises(ValueError, match=r"^rank 2 out of range 0..1$"),
    ):
        sender.send(0, 2, b"x")


def test_a_closed_receiver_says_so() -> None:
    receiver = ZMQReceiver(HOST, free_port_pair(), 0, next_step=0)
    receiver.close()
    receiver.close()
    with pytest.raises(RuntimeError, match=r"^ZMQReceiver is closed$"):
        receiver.receive(0)


def test_poll_ms_never_rounds_a_wait_down_to_zero() -> None:
    assert [_poll_ms(s) for s in (0.0, 0.0001, 0.001, 0.0015, 2.0)] == [1, 1, 1, 2, 2000]


def test_topics() -> None:
    assert topic(12, 3) == b"data_rank|3|12"
    assert parse_topic(b"data_rank|3|12") == (3, 12)
    for bad in (b"data_rank|3", b"data_rank|3|12|1", b"data_rnk|3|12", b"data_rank|x|1", b"data_rank|1|-1"):
        assert parse_topic(bad) is None, bad


def test_malformed_messages_are_dropped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port_pair()
    ctx = zmq.Context()
    publisher = ctx.socket(zmq.XPUB)
    publisher.bind(f"tcp://{HOST}:{port}")
    caplog.set_level(logging.ERROR, logger="rlship.transport")
    try:
        with ZMQReceiver(HOST, port, 1, next_step=0) as receiver:
            assert publisher.poll(int(WAIT * 1000)) and publisher.recv() == b"\x01data_rank|1|"
            publisher.send_multipart([topic(0, 1)])
            publisher.send_multipart([b"data_rank|1|x", b"payload"])
            publisher.send_multipart([topic(0, 1), b"a", b"b"])
            publisher.send_multipart([topic(0, 1), b"good"])
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
    with ZMQReceiver(HOST, free_port_pair(), 0, replay=source, replay_after=0.05, next_step=0) as receiver:
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
        HOST, free_port_pair(), 0, replay=Retained({0: b"zero"}, 3), replay_after=0.05, next_step=0
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
        ZMQSender(HOST, port, 1) as sender,
        ZMQReceiver(HOST, port, 0, replay=source, replay_after=60, next_step=0) as receiver,
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
