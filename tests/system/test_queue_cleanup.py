"""One-off queues leave nothing behind: `delete_queues` against kombu's own Redis layout,
made by kombu itself (a publish, and a message taken and never acknowledged)."""

from __future__ import annotations

import json
import uuid

import redis
from kombu import Connection, Exchange, Queue
from kombu.message import Message

from orchestrator.commands.processes import delete_queues


def unacked_routes(client: redis.Redis) -> list[str]:
    return [json.loads(entry)[2] for entry in client.hvals("unacked")]


def take(connection: Connection, queue: Queue) -> Message:
    message = connection.default_channel.basic_get(queue.name, no_ack=False)
    assert message is not None, f"nothing on {queue.name}"
    return message


def test_delete_queues_takes_lists_bindings_and_unacknowledged_messages(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    doomed, kept = (f"cleanup-{name}-{uuid.uuid4().hex[:8]}" for name in ("doomed", "kept"))
    queues = {name: Queue(name, Exchange(name, "direct"), routing_key=name) for name in (doomed, kept)}
    with Connection(redis_url) as connection:
        try:
            with connection.Producer() as producer:
                for name, count in ((doomed, 3), (kept, 2)):
                    for i in range(count):
                        producer.publish({"i": i}, exchange=name, routing_key=name, declare=[queues[name]])
            # Taken and never acknowledged, as by a worker killed mid-task.
            taken = {name: take(connection, q) for name, q in queues.items()}
            assert unacked_routes(client).count(doomed) == unacked_routes(client).count(kept) == 1
            assert client.exists(f"_kombu.binding.{doomed}") and client.llen(doomed) == 2

            delete_queues(client, [doomed])

            bindings = [f"_kombu.binding{kind}.{doomed}" for kind in ("", "_permanent")]
            assert client.exists(doomed, *bindings) == 0
            assert doomed not in unacked_routes(client)
            assert client.zscore("unacked_index", taken[doomed].delivery_tag) is None
            # Another queue's list, binding and unacknowledged message are untouched.
            assert client.llen(kept) == 1 and client.exists(f"_kombu.binding.{kept}")
            assert unacked_routes(client).count(kept) == 1
            assert client.zscore("unacked_index", taken[kept].delivery_tag) is not None
        finally:
            delete_queues(client, [doomed, kept])
    assert kept not in unacked_routes(client) and client.exists(kept, f"_kombu.binding.{kept}") == 0
