"""`Durability` against real servers: a primary, and a replica started or not.

The oracle is the replica itself (what it holds, read on its own port) and the count of
writes this test's write function made, not the code's own reply."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.commands.sentinel_cluster import start_redis_server
from orchestrator.ingest import Ingest
from orchestrator.producer import RolloutProducer
from orchestrator.rollout_log import RolloutLog
from orchestrator.settings import RunSettings
from tests.support.factories import group
from transport.keys import RunKeys
from transport.replication import Durability
from transport.zmq_sockets import free_port_pair

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def primary(tmp_path):
    port = free_port_pair()
    server = start_redis_server(tmp_path / "primary", port)
    yield port
    server.terminate()
    server.wait(10)


def test_a_write_is_acted_on_only_once_a_replica_holds_it(primary, tmp_path):
    client = redis.Redis(port=primary)
    durability = Durability(replicas=1, timeout_ms=200, probe_key="probe")
    returned = threading.Event()

    def replicate() -> None:
        durability.replicate(
            client, lambda: client.set("mark", 7), lambda pipe: pipe.exists("mark"), "the mark"
        )
        returned.set()

    writer = threading.Thread(target=replicate)
    writer.start()
    assert not returned.wait(1.0), "no replica yet: the write is not acted on"
    replica_port = free_port_pair()
    replica = start_redis_server(tmp_path / "replica", replica_port, replica_of=primary)
    try:
        assert returned.wait(30), "a replica joined and acknowledged it"
        assert redis.Redis(port=replica_port).get("mark") == b"7", "the replica holds the write"
    finally:
        writer.join(30)
        replica.terminate()
        replica.wait(10)


def test_a_write_lost_before_its_confirmation_is_written_again(primary, tmp_path):
    """As after a failover to a replica that never saw it: the witness finds it missing."""
    client = redis.Redis(port=primary)
    replica_port = free_port_pair()
    replica = start_redis_server(tmp_path / "replica", replica_port, replica_of=primary)
    writes = []

    def write() -> None:
        writes.append(client.set("mark", len(writes) + 1))
        if len(writes) == 1:
            client.delete("mark")  # lost, as with a primary that died before replicating it

    try:
        Durability(replicas=1, timeout_ms=5000, probe_key="probe").replicate(
            client, write, lambda pipe: pipe.exists("mark"), "the mark"
        )
        assert len(writes) == 2, "the lost write was written again, once"
        assert redis.Redis(port=replica_port).get("mark") == b"2", "and a replica holds it"
    finally:
        replica.terminate()
        replica.wait(10)


def test_the_orchestrator_takes_a_rollout_record_once_a_replica_holds_it_and_once(primary, tmp_path):
    """A record read on a primary that then dies before a replica has it is written again by
    its producer on the new primary: the orchestrator takes neither copy before a replica
    holds it, and the rewritten one once. The oracle is the run's accounting: what ingest
    counted as arrived and rejected."""
    url = f"redis://127.0.0.1:{primary}/0"
    client = redis.Redis(port=primary)
    run_id = "replicated-reads"
    keys = RunKeys(run_id)
    settings = RunSettings(
        run_id=run_id,
        redis_url=url,
        steps=1,
        batch_size=4,
        group_size=2,
        seq_len=64,
        output_dir=tmp_path,
        trainers="external",
        first_step=0,
        redis_wait_replicas=1,
        redis_wait_timeout_ms=100,
    )
    RolloutProducer(client, run_id).produce(group("a", [1.0, 0.0]))
    written = client.xrange(keys.rollout_stream)
    replica: list = []

    async def scenario() -> None:
        stopping, work = asyncio.Event(), asyncio.Event()
        ingest = Ingest(
            settings,
            aioredis.Redis.from_url(url),
            RolloutLog(None),
            stopping,
            work,
            lambda: 0,
            lambda: {"pending": 0.0},
        )
        reading = asyncio.create_task(ingest.run())
        try:
            await asyncio.sleep(1.0)
            assert ingest.accounting.arrived == 0, "no replica yet: nothing taken"
            # The failover: the records read are gone, and the producer writes them again.
            client.xdel(keys.rollout_stream, *(entry_id for entry_id, _ in written))
            for _, fields in written:
                client.xadd(keys.rollout_stream, fields)
            await asyncio.sleep(0.5)
            replica_port = free_port_pair()
            replica.append(start_redis_server(tmp_path / "replica", replica_port, replica_of=primary))
            deadline = time.monotonic() + 30
            while ingest.accounting.arrived < 2 or ingest.groups:
                assert time.monotonic() < deadline, "a replica joined: the records are taken"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)
            assert ingest.accounting.arrived == 2, "each record counted once"
            assert not ingest.accounting.rejected, ingest.accounting.rejected
            assert len(ingest.pending) == 2
        finally:
            stopping.set()
            await reading

    try:
        asyncio.run(scenario())
    finally:
        for server in replica:
            server.terminate()
            server.wait(10)
