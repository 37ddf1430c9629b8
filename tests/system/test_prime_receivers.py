"""The prime-rl-shaped receivers (transport.prime_receivers): prime-rl's interface, with
duplicates dropped, gaps replayed from Redis and a restarted rank catching up."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from orchestrator.commands.bench.encode import WireMicroBatch
from tests.support.factories import make_batch
from transport.codec import encode_microbatches
from transport.filesystem import FileSender
from transport.keys import RunKeys
from transport.prime_receivers import FileSystemMicroBatchReceiver, ZMQMicroBatchReceiver
from transport.store import PayloadStore
from transport.zmq_sender import ZMQSender
from transport.zmq_sockets import free_port_pair

pytestmark = pytest.mark.timeout(60)
HOST = "127.0.0.1"


def batches(step: int):
    return [make_batch(np.arange(step + 2) * 7), make_batch(np.arange(3) + step)]


def payload(step: int) -> bytes:
    return bytes(encode_microbatches(batches(step)))


def retain(store: PayloadStore, step: int, rank: int = 0) -> None:
    """What the ship path does before a send: retain the payload, mark it sent."""
    store.put_payload(step, rank, payload(step))
    store.client.set(store.keys.last_sent(rank), step)


def same(received, step: int) -> bool:
    return len(received) == 2 and all(a.equals(b) for a, b in zip(received, batches(step), strict=True))


@pytest.fixture
def store(client, run_id):
    store = PayloadStore(client, run_id)
    yield store
    store.release_payloads(ranks=1, through_step=100, evict_through=100)
    client.delete(*(key for key in client.scan_iter(match=RunKeys(run_id).prefix + "*")))


def test_zmq_receiver_drops_duplicates_and_replays_gaps_and_restarts(redis_url, run_id, store):
    port = free_port_pair()
    transport = SimpleNamespace(host=HOST, port=port, hwm=16)
    options = {"run_id": run_id, "redis_url": redis_url, "ranks": 1, "replay_after": 0.3}
    with ZMQSender(HOST, port, 1, run_id=run_id) as sender:
        receiver = ZMQMicroBatchReceiver("unused", 0, 0, transport, **options)
        try:
            assert sender.wait_ready(10)
            assert not receiver.can_receive()
            for step in (0, 0):  # a redelivered send: the stock receiver would train it twice
                retain(store, step)
                sender.send(step, 0, payload(step))
            retain(store, 1)  # sent, lost in flight
            retain(store, 2)
            sender.send(2, 0, payload(2))
            retain(store, 3)  # the last step, lost: nothing after it shows the gap
            for step in range(4):
                receiver.wait()
                assert receiver.current_step == step
                assert same(receiver.receive(), step), f"step {step} once, in order"
            assert receiver.duplicates_dropped == 1
            assert not receiver.can_receive()
        finally:
            receiver.close()
        acknowledged = {int(s) for s in store.client.hkeys(store.keys.received(0))}
        assert acknowledged == {0, 1, 2, 3}

        # Restarted from a checkpoint after step 1: steps 2 and 3 come from Redis first.
        restarted = ZMQMicroBatchReceiver("unused", 0, 2, transport, **options)
        try:
            retain(store, 4)
            sender.send(4, 0, payload(4))
            assert [same(restarted.receive(), s) for s in (2, 3, 4)] == [True] * 3
        finally:
            restarted.close()


def test_filesystem_receiver_and_prime_rl_decoding(redis_url, run_id, store, tmp_path):
    sender = FileSender(tmp_path, run_id=run_id)
    for step in (2, 1, 3):  # written out of order (a redelivered task): read in order
        sender.send(step, 0, payload(step))
    decoder = msgspec.msgpack.Decoder(type=list[WireMicroBatch]).decode
    receiver = FileSystemMicroBatchReceiver(
        tmp_path, 0, 1, run_id=run_id, redis_url=redis_url, ranks=1, decode=decoder
    )
    try:
        for step in (1, 2, 3):
            micro_batches = receiver.receive()
            assert isinstance(micro_batches[0], WireMicroBatch)
            assert micro_batches[0].input_ids == (np.arange(step + 2) * 7).tolist()
        assert not receiver.can_receive()
    finally:
        receiver.close()


def test_a_missing_setting_is_named(redis_url, monkeypatch, tmp_path):
    monkeypatch.delenv("RLSHIP_RUN_ID", raising=False)
    with pytest.raises(ValueError, match="RLSHIP_RUN_ID: not set"):
        FileSystemMicroBatchReceiver(tmp_path, 0, 1, redis_url=redis_url, ranks=1)


def test_a_rank_outside_the_run_is_refused_and_an_unknown_run_is_warned_of(redis_url, tmp_path, caplog):
    with pytest.raises(ValueError, match=r"^data_rank: 5 is not a rank of run r-x \(ranks=2: 0 to 1\)$"):
        FileSystemMicroBatchReceiver(tmp_path, 5, 1, run_id="r-x", redis_url=redis_url, ranks=2)
    caplog.set_level(logging.WARNING, logger="rlship.trainer")
    receiver = FileSystemMicroBatchReceiver(
        tmp_path, 1, 1, run_id="no-such-run", redis_url=redis_url, ranks=2
    )
    receiver.close()
    assert "run no-such-run is not in Redis (yet): waiting for its steps; is the run id right?" in caplog.text
