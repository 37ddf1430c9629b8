"""A trainer rank gets again what PUB/SUB lost: payloads are retained in Redis until every
rank acknowledges them, and the receiver replays from there (real Redis, real ZMQ sockets,
and, end to end, a real trainer process killed and restarted mid-run)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from orchestrator.commands.produce import run_producer
from orchestrator.producer import RolloutProducer
from tests.support.factories import group
from tests.support.shiprun import (
    ShipResult,
    leftover_keys,
    open_policy_gate,
    run_orchestrator,
    ship_settings,
    start_trainers,
    stop,
)
from tests.support.wire_trainer import WireTrainer
from transport.keys import RunKeys
from transport.replay import RetainedPayloads
from transport.store import PayloadStore
from transport.zmq_receiver import ZMQReceiver
from transport.zmq_sender import ZMQSender
from transport.zmq_sockets import free_port_pair

pytestmark = pytest.mark.timeout(180)
HOST = "127.0.0.1"


def payload(step: int) -> bytes:
    return b"step-%d-" % step * 1000


def handed_to_transport(store: PayloadStore, step: int, rank: int) -> None:
    """What the ship path does before a send: retain the payload, then mark it sent."""
    store.put_payload(step, rank, payload(step))
    store.client.set(store.keys.last_sent(rank), step)


def receive_all(receiver: ZMQReceiver, count: int) -> list[tuple[int, bytes]]:
    got = []
    for _ in range(count):
        message = receiver.receive(timeout=10)
        assert message is not None, f"timed out after {got and got[-1][0]}"
        got.append((message.step, bytes(message.payload)))
    return got


def test_lost_and_missed_steps_are_replayed_in_order(client, run_id):
    store = PayloadStore(client, run_id)
    port = free_port_pair()
    replay = RetainedPayloads(client, run_id)
    with (
        ZMQSender(HOST, port, 1, run_id="t") as sender,
        ZMQReceiver(
            HOST, port, 0, announce_interval=0.05, replay=replay, replay_after=0.3, next_step=0, run_id="t"
        ) as receiver,
    ):
        assert sender.wait_ready(10)
        handed_to_transport(store, 0, 0)
        sender.send(0, 0, payload(0))
        handed_to_transport(store, 1, 0)  # sent, then lost in flight: never reaches the socket
        handed_to_transport(store, 2, 0)
        sender.send(2, 0, payload(2))
        handed_to_transport(store, 3, 0)  # the last step, lost: nothing after it shows the gap
        got = receive_all(receiver, 4)
        assert got == [(s, payload(s)) for s in range(4)]
        # Steps 1 and 3 never reached the socket: only a replay can have given them (a step
        # sent before the subscription reached the sender, under load, is replayed too).
        assert receiver.replayed >= 2 and receiver.gaps == []
        sender.send(1, 0, payload(1))  # a late or repeated copy is still a duplicate
        deadline = time.monotonic() + 10
        while receiver.duplicates_dropped == 0:  # until the copy has arrived and been dropped
            assert receiver.receive(timeout=0.05) is None, "a duplicate was delivered"
            assert time.monotonic() < deadline, "the repeated copy never arrived"
        assert receiver.duplicates_dropped == 1

    # A restarted rank (acknowledged through step 1) catches up before anything new arrives.
    with ZMQReceiver(HOST, port, 0, next_step=2, replay=replay, run_id="t") as restarted:
        assert receive_all(restarted, 2) == [(2, payload(2)), (3, payload(3))]
    store.release_payloads(ranks=1, through_step=3, evict_through=3)


def test_a_step_no_longer_retained_is_reported_as_a_gap(client, run_id):
    store = PayloadStore(client, run_id)
    port = free_port_pair()
    replay = RetainedPayloads(client, run_id)
    with (
        ZMQSender(HOST, port, 1, run_id="t") as sender,
        ZMQReceiver(
            HOST, port, 0, announce_interval=0.05, replay=replay, next_step=0, run_id="t"
        ) as receiver,
    ):
        assert sender.wait_ready(10)
        client.set(store.keys.last_sent(0), 0)  # step 0 went out and was released
        handed_to_transport(store, 1, 0)
        sender.send(1, 0, payload(1))
        assert receive_all(receiver, 1) == [(1, payload(1))]
        assert receiver.gaps == [(0, 1)]
    store.release_payloads(ranks=1, through_step=1, evict_through=1)


@pytest.mark.parametrize(
    "options",
    [{}, {"workload": "moe", "payload_store": "dir"}],
    ids=["dense", "routed-experts-by-handle-payloads-in-files"],
)
def test_a_stuck_then_restarted_trainer_gets_every_step_once(
    client, redis_url, run_id, workers, tmp_path, options
):
    """Rank 1 stops reading (SIGSTOP) after step 1: the ship path keeps sending into its
    socket until the policy gate holds the orchestrator, which names the rank; then it dies
    with those steps unread (SIGKILL) and restarts: it replays them from Redis (or from the
    payload files Redis points at), and reads every step's rows by handle as they were sent."""
    steps = 7
    settings = ship_settings(run_id, redis_url, workers, tmp_path, steps=steps, max_async_level=1, **options)
    keys = RunKeys(run_id)
    status = RunKeys(run_id).status
    trainers = start_trainers(settings)

    async def scenario() -> ShipResult:
        shipping = asyncio.create_task(run_orchestrator(settings, timeout=150))
        while client.hlen(keys.received(1)) < 2:
            assert not shipping.done()
            await asyncio.sleep(0.01)
        trainers[1].send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while client.hget(status, "stalled_ranks") != b"[1]":
            assert time.monotonic() < deadline, "the stalled rank was never reported"
            await asyncio.sleep(0.05)
        assert int(client.get(keys.last_sent(1))) > max(int(s) for s in client.hkeys(keys.received(1)))
        assert not shipping.done()
        trainers[1].send_signal(signal.SIGKILL)
        trainers[1].wait()
        trainers[1] = start_trainers(settings, ranks=[1])[0]
        return await shipping

    stop_producing = threading.Event()
    producer = threading.Thread(target=run_producer, args=(settings,), kwargs={"stop": stop_producing})
    producer.start()
    try:
        result = asyncio.run(scenario())
    finally:
        stop_producing.set()
        producer.join()
        stop(trainers)
    # The run closed admission before releasing what it held, and the producer deleted the
    # files of the group it had made and could not write: no rows file is left to anything.
    leftover = sorted(p.name for p in (tmp_path / "payloads" / run_id).glob("*") if p.is_file())
    assert leftover == [], leftover[:9]
    PayloadStore(client, run_id).delete_all_rollouts()

    sent = {k.decode(): v.decode() for k, v in client.hgetall(RunKeys(run_id).sent_checksums).items()}
    sent_rows = {k.decode(): v.decode() for k, v in client.hgetall(keys.sent_rows_checksums).items()}
    assert bool(sent_rows) == bool(options), "rows by handle in every step of the moe run only"
    for rank in range(settings.ranks):
        rows = {int(s): c.decode() for s, c in client.hgetall(keys.received_rows(rank)).items()}
        assert all(rows[s] == sent_rows[f"{s}:{rank}"] for s in rows) and len(rows) == len(sent_rows) // 2
        received = {int(s): c.decode() for s, c in client.hgetall(keys.received(rank)).items()}
        deliveries = {int(s): int(n) for s, n in client.hgetall(keys.deliveries(rank)).items()}
        assert sorted(received) == list(range(steps)), f"rank {rank}: {sorted(received)}"
        assert all(received[s] == sent[f"{s}:{rank}"] for s in received), f"rank {rank}: bytes differ"
        assert set(deliveries.values()) == {1}, f"rank {rank} delivered a step twice: {deliveries}"
    trainer_log = (tmp_path / "logs" / "trainer-1.log").read_text()
    assert "replayed from the retained payloads" in trainer_log
    assert result.summary["steps_shipped"] == steps
    assert result.summary["steps_unacknowledged"] == []
    assert leftover_keys(client, run_id) == []
    assert not (tmp_path / "step-payloads" / run_id).exists(), "the payload files went with their steps"


def test_the_replay_window_holds_exactly_replay_steps_steps(client, redis_url, run_id, workers, tmp_path):
    """Ranks that never acknowledge (prime-rl's stock receivers, here plain sockets) leave
    every retained payload to the window: once step s is released, a rank restarting replays
    exactly steps s - replay_steps + 1 .. s, and nothing from the step before them. A window one
    step shorter fails rank 0 below (its first step gone), one longer fails rank 1 (replayed)."""
    window, shipped = 3, 6
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=shipped + 1, ranks=2, batch_size=8, group_size=4,
        trainers="external", max_async_level=window - 2, replay_steps=window, max_off_policy_steps=100,
        samples_per_step=0, first_step=0,
    )  # fmt: skip
    open_policy_gate(settings)
    producer = RolloutProducer(client, run_id)
    for index in range(shipped * 2):  # two groups of 4 a step: the last step waits for more
        producer.produce(group(f"w{index}", [1.0, 0.0, 1.0, 0.0]))
    keys = RunKeys(run_id)
    retained = RetainedPayloads(client, run_id)

    def restarted_rank(rank: int, next_step: int) -> tuple[list[int], list[tuple[int, int]]]:
        port = settings.zmq_port
        with ZMQReceiver(
            HOST, port, rank, next_step=next_step, replay=retained, replay_after=0.2, run_id=run_id
        ) as receiver:
            got = [m.step for m in iter(lambda: receiver.receive(timeout=3), None)]
            return got, receiver.gaps

    async def scenario() -> tuple[tuple, tuple]:
        shipping = asyncio.create_task(run_orchestrator(settings, timeout=150))
        with WireTrainer(HOST, settings.zmq_port, 2) as stock:
            deadline = time.monotonic() + 90
            while client.hlen(keys.released) < shipped:
                assert not shipping.done() and time.monotonic() < deadline, "steps were not released"
                await asyncio.sleep(0.05)
            assert sorted(step for rank, step, _ in stock.messages if rank == 0) == list(range(shipped))
        loop = asyncio.get_running_loop()
        inside = await loop.run_in_executor(None, restarted_rank, 0, shipped - window)
        before = await loop.run_in_executor(None, restarted_rank, 1, shipped - window - 1)
        for index in range(shipped * 2, shipped * 2 + 2):  # the last step, so the run ends
            producer.produce(group(f"w{index}", [1.0, 0.0, 1.0, 0.0]))
        with WireTrainer(HOST, settings.zmq_port, 2):
            await shipping
        return inside, before

    inside, before = asyncio.run(scenario())
    PayloadStore(client, run_id).delete_all_rollouts()
    assert inside == (list(range(shipped - window, shipped)), []), "the window's steps, replayed"
    # Step 2 is gone: the replay stops at the first step it no longer holds (the gap shows
    # once a live step arrives); a longer window would have replayed 2..5.
    assert before == ([], []), "a step older than the window, replayed"
    assert leftover_keys(client, run_id) == []
