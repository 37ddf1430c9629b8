"""ZMQ step transport against real sockets and real processes (spawned, so no fork of a
zmq context). Ports are picked free at run time; every wait is bounded."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing as mp
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from transport.base import ReceivedStep, StepReceiver, StepSender, StepSequencer
from transport.zmq_receiver import ZMQReceiver
from transport.zmq_sender import ZMQSender
from transport.zmq_sockets import free_port_pair

HOST = "127.0.0.1"
MIB = 1 << 20
SIZES = [0, 1, 4096, 3 * MIB + 17, MIB]
CTX = mp.get_context("spawn")
WAIT = 30.0  # generous bound for anything that involves another process starting up


def payload_for(step: int, rank: int) -> bytes:
    size = SIZES[(step + rank) % len(SIZES)]
    return random.Random(step * 1000 + rank).randbytes(size)


def digest(payload: bytes | memoryview) -> str:
    return hashlib.sha256(payload).hexdigest()


def receiver_main(port: int, rank: int, steps: int, queue: Any, timeout: float) -> None:
    """Child process: receive `steps` steps and report (step, size, sha256) of each."""
    with ZMQReceiver(HOST, port, rank, announce_interval=0.2, next_step=0, run_id="t") as receiver:
        queue.put(("started", rank))
        for _ in range(steps):
            got = receiver.receive(timeout)
            if got is None:
                queue.put(("timeout", rank, receiver.next_step))
                return
            queue.put(("step", rank, got.step, len(got.payload), digest(got.payload)))
        extra = receiver.receive(0.5)
        queue.put(("done", rank, receiver.duplicates_dropped, receiver.gaps, extra is None))


def sender_main(port: int, ranks: int, steps: int, queue: Any, finished: Any) -> None:
    """Child process: send every (step, rank), cycling bytes/bytearray/memoryview payloads,
    and keep the socket open until the parent has seen everything arrive."""
    kinds: list[Callable[[bytes], bytes | bytearray | memoryview]] = [bytes, bytearray, memoryview]
    with ZMQSender(HOST, port, ranks, run_id="t") as sender:
        if not sender.wait_ready(WAIT):
            queue.put(("not-ready", sorted(sender.ready_ranks)))
            return
        for step in range(steps):
            for rank in range(ranks):
                sender.send(step, rank, kinds[step % 3](payload_for(step, rank)))
        queue.put(("sent",))
        finished.wait(WAIT)


def start(procs: list[Any], target: Callable[..., None], *args: Any) -> Any:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    procs.append(proc)
    return proc


def collect(queue: Any, kind: str, count: int) -> list[tuple[Any, ...]]:
    """`count` messages of `kind` from the queue; fails on any timeout/not-ready report."""
    got: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + WAIT
    while len(got) < count:
        msg = queue.get(timeout=max(0.1, deadline - time.monotonic()))
        assert msg[0] not in ("timeout", "not-ready"), msg
        if msg[0] == kind:
            got.append(msg)
    return got


@contextlib.contextmanager
def in_process_pair(ranks: int = 1, **sender_kwargs: Any) -> Iterator[tuple[ZMQSender, list[ZMQReceiver]]]:
    """A sender and its ready receivers in this process, all closed on the way out (closing
    is idempotent: a test may close one itself first)."""
    port = free_port_pair()
    sender = ZMQSender(HOST, port, ranks, **sender_kwargs, run_id="t")
    receivers = [
        ZMQReceiver(HOST, port, rank, announce_interval=0.2, next_step=0, run_id="t") for rank in range(ranks)
    ]
    try:
        assert sender.wait_ready(WAIT)
        yield sender, receivers
    finally:
        for receiver in receivers:
            receiver.close()
        sender.close()


def test_transport_imports_neither_celery_nor_upper_layers() -> None:
    code = (
        "import sys, transport.base, transport.zmq_sender, transport.zmq_receiver, transport.filesystem\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'orchestrator', 'tasks'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=WAIT, cwd=Path(__file__).parents[2])


@pytest.mark.timeout(60)
def test_protocols_are_satisfied() -> None:
    with in_process_pair() as (sender, (receiver,)):
        assert isinstance(sender, StepSender)
        assert isinstance(receiver, StepReceiver)


@pytest.mark.timeout(60)
def test_one_sender_three_receiver_processes_every_step_in_order_byte_identical(procs: list[Any]) -> None:
    port, ranks, steps = free_port_pair(), 3, 5
    queue, finished = CTX.Queue(), CTX.Event()
    for rank in range(ranks):
        start(procs, receiver_main, port, rank, steps, queue, WAIT)
    start(procs, sender_main, port, ranks, steps, queue, finished)
    try:
        reports = collect(queue, "step", ranks * steps)
        done = collect(queue, "done", ranks)
    finally:
        finished.set()
    for rank in range(ranks):
        mine = [r for r in reports if r[1] == rank]
        assert [r[2] for r in mine] == list(range(steps))  # in order, each once
        for _, _, step, size, sha in mine:
            expected = payload_for(step, rank)
            assert (size, sha) == (len(expected), digest(expected))
    assert {len(payload_for(s, r)) for s in range(steps) for r in range(ranks)} >= {0, 3 * MIB + 17}
    for _, _rank, duplicates, gaps, nothing_more in done:
        assert (duplicates, gaps, nothing_more) == (0, [], True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("receivers_first", [True, False], ids=["receivers-first", "sender-first"])
def test_ready_barrier_whichever_side_starts_first(procs: list[Any], receivers_first: bool) -> None:
    port, ranks = free_port_pair(), 2
    queue = CTX.Queue()

    def start_receivers() -> None:
        for rank in range(ranks):
            start(procs, receiver_main, port, rank, 1, queue, WAIT)

    if receivers_first:
        start_receivers()
        collect(queue, "started", ranks)
        time.sleep(0.5)  # their connects are now retrying against a port nobody binds
    with ZMQSender(HOST, port, ranks, run_id="t") as sender:
        if not receivers_first:
            assert not sender.wait_ready(0.2)  # nobody there yet: the barrier holds
            start_receivers()
        assert sender.wait_ready(WAIT)
        assert sender.ready_ranks == frozenset(range(ranks))
        for rank in range(ranks):
            sender.send(0, rank, payload_for(0, rank))
        reports = collect(queue, "step", ranks)
    assert sorted((r[1], r[2], r[4]) for r in reports) == [
        (rank, 0, digest(payload_for(0, rank))) for rank in range(ranks)
    ]


@pytest.mark.timeout(60)
def test_ready_needs_the_subscription_not_only_the_announcement() -> None:
    """A READY that overtakes the subscription must not open the barrier (slow joiner)."""
    port = free_port_pair()
    ctx = zmq.Context()
    try:
        with ZMQSender(HOST, port, 1, run_id="t") as sender:
            push = ctx.socket(zmq.PUSH)
            push.linger = 0
            push.connect(f"tcp://{HOST}:{port + 1}")
            push.send(b"0")
            assert not sender.wait_ready(1.0)
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            sub.setsockopt(zmq.SUBSCRIBE, b"data_rank|0|")
            sub.connect(f"tcp://{HOST}:{port}")
            assert sender.wait_ready(WAIT)
            sender.send(7, 0, b"hello")
            assert sub.poll(int(WAIT * 1000))
            assert sub.recv_multipart() == [b"data_rank|0|7|t", b"hello"]
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_wait_ready_times_out_while_a_rank_is_missing() -> None:
    port = free_port_pair()
    with ZMQSender(HOST, port, 2, run_id="t") as sender, ZMQReceiver(HOST, port, 0, next_step=0, run_id="t"):
        start_time = time.monotonic()
        assert not sender.wait_ready(1.0)
        assert time.monotonic() - start_time < 5
        deadline = time.monotonic() + WAIT
        while sender.ready_ranks != {0} and time.monotonic() < deadline:
            sender.wait_ready(0.1)
        assert sender.ready_ranks == {0}
        assert not sender.ready


@pytest.mark.timeout(60)
def test_duplicate_step_is_dropped_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rlship.transport")
    with in_process_pair() as (sender, (receiver,)):
        sender.send(0, 0, b"zero")
        sender.send(0, 0, b"zero")
        sender.send(1, 0, b"one")
        first, second = receiver.receive(WAIT), receiver.receive(WAIT)
        assert isinstance(first, ReceivedStep) and (first.step, first.rank) == (0, 0)
        assert bytes(first.payload) == b"zero"
        assert second is not None and (second.step, bytes(second.payload)) == (1, b"one")
        assert receiver.receive(0.3) is None
        assert receiver.duplicates_dropped == 1
        assert receiver.gaps == []
        assert receiver.next_step == 2
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "duplicate" in r.message]
        assert len(warnings) == 1


@pytest.mark.timeout(60)
def test_gap_is_reported_and_a_late_step_is_not_delivered(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rlship.transport")
    with in_process_pair() as (sender, (receiver,)):
        for step in (0, 2, 1, 3):
            sender.send(step, 0, b"step %d" % step)
        delivered = [receiver.receive(WAIT) for _ in range(3)]
        assert [d.step for d in delivered if d is not None] == [0, 2, 3]
        assert receiver.receive(0.3) is None
        assert receiver.gaps == [(1, 2)]
        assert receiver.late_dropped == 1
        assert receiver.duplicates_dropped == 0
        assert any(r.levelno == logging.ERROR and "gap" in r.message for r in caplog.records)


@pytest.mark.timeout(60)
def test_receiver_resumed_at_a_later_step_drops_earlier_ones() -> None:
    port = free_port_pair()
    with (
        ZMQSender(HOST, port, 1, run_id="t") as sender,
        ZMQReceiver(HOST, port, 0, next_step=5, run_id="t") as receiver,
    ):
        assert sender.wait_ready(WAIT)
        sender.send(4, 0, b"old")
        sender.send(5, 0, b"new")
        got = receiver.receive(WAIT)
        assert got is not None and (got.step, bytes(got.payload)) == (5, b"new")
        assert (receiver.duplicates_dropped, receiver.gaps) == (1, [])


@pytest.mark.timeout(60)
def test_replacement_sender_on_same_port_reaches_a_running_receiver(procs: list[Any]) -> None:
    """The first sender consumed the receiver's READY; only a re-announce can reach the second."""
    port = free_port_pair()
    queue = CTX.Queue()
    start(procs, receiver_main, port, 0, 2, queue, WAIT)
    with ZMQSender(HOST, port, 1, run_id="t") as first:
        assert first.wait_ready(WAIT)
        first.send(0, 0, payload_for(0, 0))
        assert collect(queue, "step", 1)[0][2] == 0
    with ZMQSender(HOST, port, 1, run_id="t") as second:
        assert second.wait_ready(WAIT)
        second.send(1, 0, payload_for(1, 0))
        (report,) = collect(queue, "step", 1)
    assert (report[2], report[4]) == (1, digest(payload_for(1, 0)))
    assert collect(queue, "done", 1)[0][2:4] == (0, [])


@pytest.mark.timeout(60)
def test_payload_outlives_receiver_close() -> None:
    data = payload_for(0, 3)  # 3 MiB: a real zero-copy frame, not a small inline message
    with in_process_pair() as (sender, (receiver,)):
        sender.send(0, 0, data)
        got = receiver.receive(WAIT)
    assert got is not None and digest(got.payload) == digest(data)


@pytest.mark.timeout(60)
def test_close_is_prompt_without_a_peer() -> None:
    port = free_port_pair()
    sender = ZMQSender(HOST, port, 2, send_timeout=0.5, run_id="t")
    with pytest.raises(TimeoutError):
        sender.send(0, 0, b"nobody is listening")
    start_time = time.monotonic()
    sender.close()
    sender.close()  # idempotent
    assert time.monotonic() - start_time < 2.5

    receiver = ZMQReceiver(HOST, free_port_pair(), 0, announce_interval=0.05, next_step=0, run_id="t")
    assert receiver.receive(0.3) is None
    start_time = time.monotonic()
    receiver.close()
    assert time.monotonic() - start_time < 2.5
    with pytest.raises(RuntimeError):
        receiver.receive(0)


@pytest.mark.timeout(60)
def test_close_is_prompt_with_undelivered_messages_queued() -> None:
    """A receiver that stops reading: the sender's queue fills (send blocks, here until
    send_timeout), and close() still returns within about linger_ms."""
    big = b"x" * (4 * MIB)
    sent = 0
    with in_process_pair(hwm=2, send_timeout=1.0, linger_ms=1000) as (sender, (receiver,)):
        with pytest.raises(
            TimeoutError,
            match=r"^rank 0 step \d+: (send queue full|still queued in libzmq) past send_timeout$",
        ):
            for step in range(1000):
                sender.send(step, 0, big)
                sent += 1
        assert sent >= 2
        start_time = time.monotonic()
        sender.close()
        assert time.monotonic() - start_time < 4.0
        start_time = time.monotonic()
        receiver.close()
        assert time.monotonic() - start_time < 2.5


def test_sequencer_rules(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rlship.transport")
    seq = StepSequencer(rank=0, next_step=2)
    assert [seq.admit(s) for s in (2, 1, 1, 3, 6, 3, 4, 7)] == [
        True,
        False,
        False,
        True,
        True,
        False,
        False,
        True,
    ]
    assert seq.next_step == 8
    assert seq.duplicates_dropped == 3  # 1, 1 (before the start) and 3 (delivered)
    assert seq.late_dropped == 1  # 4: inside the gap 4..5, never delivered, too late now
    assert seq.gaps == [(4, 6)]
    duplicate_warnings = [r for r in caplog.records if "duplicate step 1 " in r.message]
    assert len(duplicate_warnings) == 1
    with pytest.raises(ValueError):
        StepSequencer(rank=0, next_step=-1)


def test_sender_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ZMQSender(HOST, free_port_pair(), 0, run_id="t")
    with ZMQSender(HOST, free_port_pair(), 2, run_id="t") as sender:
        with pytest.raises(ValueError):
            sender.send(0, 2, b"")
        with pytest.raises(ValueError):
            sender.send(-1, 0, b"")
    with pytest.raises(RuntimeError):
        sender.send(0, 0, b"")


def test_bind_failure_leaves_nothing_open() -> None:
    port = free_port_pair()
    with ZMQSender(HOST, port, 1, run_id="t"), pytest.raises(zmq.ZMQError):
        ZMQSender(HOST, port, 1, run_id="t")


@pytest.mark.timeout(60)
def test_a_departed_rank_does_not_hold_back_the_others() -> None:
    """Sending to rank 0 needs rank 0 only; sending to a rank whose trainer left waits (a
    publish to no subscriber would be lost) and times out."""
    with in_process_pair(ranks=2, send_timeout=1.0) as (sender, (rank0, rank1)):
        rank1.close()
        deadline = time.monotonic() + WAIT
        while 1 in sender.ready_ranks and time.monotonic() < deadline:
            sender.wait_ready(0.05, rank=0)
        assert sender.ready_ranks == frozenset({0})
        sender.send(0, 0, b"still delivered")
        received = rank0.receive(WAIT)
        assert received is not None and bytes(received.payload) == b"still delivered"
        with pytest.raises(TimeoutError, match="rank 1 step 0: not ready"):
            sender.send(0, 1, b"nobody listens")


@pytest.mark.timeout(60)
def test_a_replacement_sender_reaches_a_rank_while_another_has_left() -> None:
    """A ship worker started again after rank 1 finished (and left) still sends to rank 0."""
    port = free_port_pair()
    with (
        ZMQReceiver(HOST, port, 0, announce_interval=0.05, next_step=0, run_id="t") as rank0,
        ZMQSender(HOST, port, 2, send_timeout=WAIT, run_id="t") as sender,
    ):
        assert not sender.wait_ready(0.3), "rank 1 never came"
        sender.send(3, 0, b"for rank 0")
        received = rank0.receive(WAIT)
        assert received is not None and (received.step, bytes(received.payload)) == (3, b"for rank 0")
