"""rlship against trainer ranks that receive as prime-rl's stock ones do (tests/support/stock_peers.py):
READY once, no duplicate check, no replay, their own step count from 1 (prime-rl's
numbering, the default with `trainers = "external"`), or from a resumed trainer's step.

- A replacement sender reaches a rank that announced READY only to its predecessor
  (the announcement is kept in Redis).
- A message counts as sent only once it has left the process: a send that times out with
  the message still queued does not publish a second copy when called again.
- End to end: the ship worker SIGKILLed 5 times during a 30-step run, over ZMQ and over
  the filesystem; every stock rank receives every step once, in order, byte for byte as
  encoded.
- The window that remains, at its two edges: killed after the `sending` mark and before
  the message left, the step is sent again and arrives once; killed after it left and
  before `last_sent` (the `send` fault point), it arrives twice. Both are counted.
- A trainer resumed at step 5: the run's first topic, file and record are step 5.
- Stock ranks never acknowledge: every step past the replay window is evicted
  unacknowledged, each counted, and the workers warn once a run, not once a step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq

from orchestrator.commands.processes import delete_run_keys
from tasks.faults import arm
from tests.support.factories import payload
from tests.support.processes import running_workers, wait_for
from tests.support.shiprun import deterministic_run, metrics_lines, run_orchestrator, ship_to_stock_ranks
from tests.support.stock_peers import await_every_step, read_record, start_stock_peer, start_stock_ranks
from transport.announcements import RedisAnnouncements
from transport.keys import RunKeys
from transport.zmq_sender import ZMQSender
from transport.zmq_sockets import free_port_pair

pytestmark = pytest.mark.timeout(300)
HOST = "127.0.0.1"


def stock_socket(context: zmq.Context, port: int, rank: int) -> zmq.Socket:
    """A SUB as prime-rl's receiver makes it, its one READY already sent."""
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://{HOST}:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"data_rank|%d|" % rank)
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(f"tcp://{HOST}:{port + 1}")
    push.send(str(rank).encode())
    push.close()
    return sub


def test_a_replacement_sender_reaches_a_rank_that_announced_once(client, run_id, tmp_path):
    port = free_port_pair()
    record = tmp_path / "rank0.jsonl"
    peer = start_stock_peer("zmq", 0, record, output_dir=tmp_path, port=port, start_step=1, steps=2)
    try:
        with ZMQSender(HOST, port, 1, announcements=RedisAnnouncements(client, run_id), run_id="t") as first:
            assert first.wait_ready(20)
            first.send(1, 0, payload(1))
        wait_for("the peer to record its first step", lambda: len(read_record(record)) == 1)

        with ZMQSender(HOST, port, 1, run_id="t") as forgetful:  # what a replacement knew before
            assert not forgetful.wait_ready(1.5), "no READY comes again"
        with ZMQSender(HOST, port, 1, announcements=RedisAnnouncements(client, run_id), run_id="t") as second:
            assert second.wait_ready(20), "announced to the first sender, subscribed to this one"
            second.send(2, 0, payload(2))
            assert peer.wait(20) == 0
    finally:
        peer.kill()
        ttl = client.ttl(RunKeys(run_id).announced_ranks)
        client.delete(RunKeys(run_id).announced_ranks)
    assert [r["topic_step"] for r in read_record(record)] == [1, 2]
    assert ttl > 0, "the announcements expire with an abandoned run"


def test_a_send_returns_once_the_message_left_and_is_never_queued_twice():
    port = free_port_pair()
    context = zmq.Context()
    sub = stock_socket(context, port, 0)
    sub.setsockopt(zmq.RCVHWM, 1)
    big = bytes(range(256)) * (1 << 14)  # 4 MiB: kernel buffers fill while nobody reads
    try:
        with ZMQSender(HOST, port, 1, send_timeout=0.5, run_id="t") as sender:
            assert sender.wait_ready(10)
            sent = 0
            with pytest.raises(TimeoutError, match="still queued in libzmq"):
                for step in range(64):
                    sender.send(step, 0, big)
                    sent += 1
            stuck = sent  # handed to libzmq, not out of the process yet
            with pytest.raises(TimeoutError, match="still queued"):
                sender.send(stuck, 0, big)  # the same message: waited for, not queued again
            got = [sub.recv_multipart()[0] for _ in range(stuck + 1)]
            sender.send(stuck, 0, big)  # returns now: it has left
            assert got == [b"data_rank|0|%d|t" % s for s in range(stuck + 1)]
            assert not sub.poll(500), "one copy of the step that timed out"
    finally:
        sub.close(linger=0)
        context.term()


STEPS = 30
KILLS = 5


def kill_tree(process: psutil.Process) -> None:
    """SIGKILL a worker and its pool children (the child owns the sockets)."""
    children = process.children(recursive=True)
    process.kill()
    for child in children:
        child.kill()


@pytest.mark.parametrize("transport", ["zmq", "fs"])
def test_ship_worker_killed_five_times_stock_ranks_get_every_step_once(
    transport, client, redis_url, run_id, tmp_path
):
    (tmp_path / "worker-logs").mkdir()
    with running_workers(redis_url, tmp_path / "worker-logs") as workers:
        settings = deterministic_run(client, run_id, redis_url, workers, tmp_path, STEPS).with_changes(
            trainers="external", stall_seconds=3.0, transport=transport
        )
        assert settings.step_numbers == range(1, STEPS + 1), "numbered as prime-rl numbers them"
        # Over ZMQ a rank reads until stopped: one that stopped after 30 messages would count
        # a duplicate as a step and never take the last one.
        records, peers = start_stock_ranks(settings, [STEPS if transport == "fs" else None] * settings.ranks)
        outcome: dict[str, object] = {}
        orchestrator = threading.Thread(
            target=lambda: outcome.update(result=asyncio.run(run_orchestrator(settings, timeout=240)))
        )
        orchestrator.start()
        published = RunKeys(run_id).published
        kills = 0
        try:
            for threshold in range(3, 3 + 5 * KILLS, 5):
                while client.hlen(published) < threshold and orchestrator.is_alive():
                    time.sleep(0.02)
                if not orchestrator.is_alive():
                    break
                kill_tree(psutil.Process(workers.processes["ship"].pid))
                workers.processes["ship"].wait()
                kills += 1
                workers.start("ship")
            orchestrator.join(240)
            assert not orchestrator.is_alive(), "the run ended"
            assert "result" in outcome, "the orchestrator finished without error"
            await_every_step(transport, peers, records, STEPS)
        finally:
            for peer in peers:
                peer.kill()
        assert kills == KILLS, "every kill landed mid-run"
        checksums = client.hgetall(RunKeys(run_id).sent_checksums)
        encoded = {key.decode(): value.decode() for key, value in checksums.items()}
        steps = list(range(1, STEPS + 1))
        interrupted = {k.decode() for k in client.hkeys(RunKeys(run_id).interrupted_sends)}
        for rank, record in enumerate(records):
            got = read_record(record)
            if transport == "fs":
                assert [r["step"] for r in got] == steps, f"rank {rank}: once each, in order"
            else:
                # The one duplicate the design leaves (README, Reliability): a ship worker
                # killed after a message left it and before its mark reached Redis, whose
                # step is then sent again, right after itself. Any other is a bug.
                topics = [r["topic_step"] for r in got]
                again = [b for a, b in itertools.pairwise(topics) if a == b]
                assert all(f"{step}:{rank}" in interrupted for step in again), (rank, topics, interrupted)
                assert [t for i, t in enumerate(topics) if i == 0 or topics[i - 1] != t] == steps, topics
            for entry in got:
                step = entry["step"] if transport == "fs" else entry["topic_step"]
                assert entry["xxh3_128"] == encoded[f"{step}:{rank}"], "byte for byte"
        assert [int(r["step"]) for r in metrics_lines(settings)] == steps, "records numbered alike"
        if transport == "fs":
            assert step_dirs(tmp_path) == steps
        print(f"ship worker killed {kills} times; sends interrupted and resent: {sorted(interrupted)}")
    delete_run_keys(settings)


@pytest.mark.parametrize(
    ("fault", "order"),
    [("sending", [1, 2, 3]), ("send", [1, 2, 2, 3])],
    ids=["killed-before-it-left", "killed-after-it-left"],
)
def test_the_window_left_by_a_killed_send(fault, order, client, redis_url, run_id, tmp_path):
    (tmp_path / "worker-logs").mkdir()
    with running_workers(redis_url, tmp_path / "worker-logs", env={"RLSHIP_FAULTS": "1"}) as workers:
        settings = deterministic_run(client, run_id, redis_url, workers, tmp_path, 3).with_changes(
            trainers="external", stall_seconds=3.0
        )
        arm(client, run_id, fault, step=2, rank=1)
        records = ship_to_stock_ranks(settings, [3, len(order)])
    assert client.hlen(RunKeys(run_id).faults) == 0, "the armed fault fired"
    assert [r["topic_step"] for r in read_record(records[0])] == [1, 2, 3]
    assert [r["topic_step"] for r in read_record(records[1])] == order
    interrupted = client.hgetall(RunKeys(run_id).interrupted_sends)
    if fault == "send":  # the batch's other ranks were marked before the kill
        assert interrupted == {b"2:1": b"1"}, "the resend is counted"
    else:  # rank 0's too if rank 0's task was sending both: every mark precedes the hand-overs
        assert b"2:1" in interrupted and set(interrupted) <= {b"2:0", b"2:1"}, interrupted
        assert set(interrupted.values()) == {b"1"}, "each resend counted once"
    delete_run_keys(settings)


def step_dirs(output_dir: Path) -> list[int]:
    """The steps the run wrote files for, in order."""
    return sorted(int(path.name.removeprefix("step_")) for path in (output_dir / "rollouts").glob("step_*"))


@pytest.mark.parametrize("transport", ["zmq", "fs"])
def test_a_trainer_resumed_at_step_5_gets_step_5_first(transport, client, redis_url, run_id, tmp_path):
    """prime-rl's trainer resumed from its step-5 checkpoint expects step 5 next: rlship's
    first topic, file and record are step 5, then 6 and 7."""
    (tmp_path / "worker-logs").mkdir()
    with running_workers(redis_url, tmp_path / "worker-logs") as workers:
        settings = deterministic_run(client, run_id, redis_url, workers, tmp_path, 3).with_changes(
            trainers="external", transport=transport, start_step=5
        )
        records = ship_to_stock_ranks(settings, [3, 3])
    for record in records:
        got = read_record(record)
        assert [r["step"] for r in got] == [5, 6, 7]
        if transport == "zmq":
            assert [r["topic_step"] for r in got] == [5, 6, 7], "the first topic is data_rank|r|5"
    if transport == "fs":
        assert step_dirs(tmp_path) == [5, 6, 7], "the first file is rollouts/step_5/rank_r.bin"
    assert [int(r["step"]) for r in metrics_lines(settings)] == [5, 6, 7]
    delete_run_keys(settings)


def test_stock_ranks_evict_every_step_counted_and_warned_of_once(client, redis_url, run_id, tmp_path):
    """The release of each step past the replay window evicts a step no stock rank
    acknowledged. Each is counted in Redis; the workers (logging at WARNING) say so once."""
    logs = tmp_path / "worker-logs"
    logs.mkdir()
    steps, replay_steps = 7, 3
    with running_workers(redis_url, logs) as workers:
        settings = deterministic_run(client, run_id, redis_url, workers, tmp_path, steps).with_changes(
            trainers="external", replay_steps=replay_steps
        )
        ship_to_stock_ranks(settings, [steps, steps])
    evicted = int(client.hget(RunKeys(run_id).evicted, "steps") or 0)
    assert evicted >= steps - replay_steps - 1 >= 3, "a step evicted unacknowledged at several releases"
    lines = [line for path in logs.glob("*.log") for line in path.read_text().splitlines()]
    warned = [line for line in lines if "evicted from the replay window" in line]
    assert len(warned) == 1 and "WARNING" in warned[0], warned
    assert "stock receivers" in warned[0]
    delete_run_keys(settings)
