"""The stock-behaving trainer peers themselves: what they receive, count and announce."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.support.factories import payload
from tests.support.processes import wait_for
from tests.support.stock_peers import (
    pause_announcements,
    read_record,
    resume_announcements,
    start_stock_peer,
)
from transport.filesystem import FileSender
from transport.zmq_sender import ZMQSender
from transport.zmq_sockets import free_port_pair

pytestmark = pytest.mark.timeout(60)


def test_zmq_peer_counts_steps_itself_and_keeps_duplicates(tmp_path: Path):
    port = free_port_pair()
    record = tmp_path / "rank0.jsonl"
    peer = start_stock_peer("zmq", 0, record, output_dir=tmp_path, port=port, steps=3)
    try:
        with ZMQSender("127.0.0.1", port, 1, run_id="t") as sender:
            assert sender.wait_ready(20)
            for step in (7, 7, 9):  # a duplicate and a gap: the peer notices neither
                sender.send(step, 0, payload(step))
            assert peer.wait(20) == 0
    finally:
        peer.kill()
    got = read_record(record)
    assert [(r["step"], r["topic_step"]) for r in got] == [(1, 7), (2, 7), (3, 9)]
    assert [r["sha256"] for r in got] == [hashlib.sha256(payload(s)).hexdigest() for s in (7, 7, 9)]
    assert (tmp_path / "broadcasts" / "step_3" / "STABLE").exists()


def test_fs_peer_polls_from_its_start_step_and_announcing_pauses(tmp_path: Path):
    record = tmp_path / "rank0.jsonl"
    pause_announcements(record)
    peer = start_stock_peer("fs", 0, record, output_dir=tmp_path, steps=2, poll=0.05)
    try:
        sender = FileSender(tmp_path, run_id="t")
        for step in (0, 1, 2):
            sender.send(step, 0, payload(step))
        wait_for("the peer to record both steps", lambda: len(read_record(record)) == 2)
        assert [r["sha256"] for r in read_record(record)] == [
            hashlib.sha256(payload(s)).hexdigest() for s in (1, 2)
        ]
        assert not (tmp_path / "broadcasts").exists()  # paused: not even version 0
        resume_announcements(record)
        assert peer.wait(20) == 0
    finally:
        peer.kill()
    assert all((tmp_path / "broadcasts" / f"step_{v}" / "STABLE").exists() for v in (0, 1, 2))
