"""`Durability.replicate` against real servers: a primary, and a replica started or not.

The oracle is the replica itself (what it holds, read on its own port) and the count of
writes this test's write function made, not the code's own reply."""

from __future__ import annotations

import threading

import pytest
import redis

from orchestrator.commands.sentinel_cluster import start_redis_server
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
