"""A claim check is written once: a second write of a rollout id is refused and counted and
the first one's arrays stay exactly as written; one id twice in one call, or arrays beyond
the run's limits, are refused before anything is written (against a real Redis)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis

from orchestrator.producer import AsyncRolloutProducer, RolloutProducer, RolloutRejected
from orchestrator.settings import RunSettings
from tests.support.factories import rollout
from transport.arrays_blob import unpack_arrays


def stored_ids(client, run_id: str, rollout_id: str) -> np.ndarray:
    """The input_ids held under the rollout's key, read straight from Redis."""
    return unpack_arrays(client.get(f"rlship:{run_id}:rollout:{rollout_id}"))["input_ids"]


def cleanup(client, run_id: str) -> None:
    keys = client.keys(f"rlship:{run_id}:*")
    if keys:
        client.delete(*keys)


def test_a_second_write_of_a_rollout_id_is_refused_and_the_original_kept(client, run_id):
    producer = RolloutProducer(client, run_id)
    original = rollout("r1", "g", 1.0, num_output_tokens=6)
    impostor = rollout("r1", "g", 0.0, num_output_tokens=9)
    impostor[1]["input_ids"][:] = 7
    try:
        producer.produce([original])
        with pytest.raises(RolloutRejected) as info:
            producer.produce([rollout("r2", "g", 0.0), impostor])
        assert list(info.value.problems) == ["r1"]
        assert "already stored" in info.value.problems["r1"]
        np.testing.assert_array_equal(stored_ids(client, run_id, "r1"), original[1]["input_ids"])
        records = client.xrange(f"rlship:{run_id}:rollouts")
        assert [r[1][b"record"].count(b'"r1"') + r[1][b"record"].count(b'"r2"') for r in records] == [1, 1]
        assert int(client.get(f"rlship:{run_id}:rollout_writes_refused")) == 1
        assert int(client.get(f"rlship:{run_id}:produced")) == 2
    finally:
        cleanup(client, run_id)


def test_a_producer_writing_after_its_run_ended_leaves_nothing_without_an_expiry(client, run_id):
    """The run's keys are unlinked when it ends; a producer still writing makes its stream
    and counters again, each with the payloads' expiry (a `rlship run` under honcho left
    its stream for ever)."""
    producer = RolloutProducer(client, run_id, ttl_seconds=600)
    try:
        producer.produce([rollout("early", "g", 1.0)])
        cleanup(client, run_id)  # as the end of the run does
        producer.produce([rollout("late", "g", 1.0)])
        with pytest.raises(RolloutRejected):
            producer.produce([rollout("late", "g", 1.0)])
        names = ("rollouts", "produced", "rollout_writes_refused")
        assert client.exists(*(f"rlship:{run_id}:{name}" for name in names)) == 3
        assert all(0 < client.ttl(key) <= 600 for key in client.keys(f"rlship:{run_id}:*"))
    finally:
        cleanup(client, run_id)


def test_one_id_twice_in_one_call_writes_nothing(client, run_id, redis_url):
    first, second = rollout("d1", "g", 1.0), rollout("d1", "g", 0.0)
    with pytest.raises(RolloutRejected, match="'d1' appears twice in this call"):
        RolloutProducer(client, run_id).produce([first, second])

    async def produce_async() -> None:
        async_client = aioredis.Redis.from_url(redis_url)
        try:
            await AsyncRolloutProducer(async_client, run_id).produce([first, second])
        finally:
            await async_client.aclose()

    with pytest.raises(RolloutRejected, match="appears twice"):
        asyncio.run(produce_async())
    assert client.keys(f"rlship:{run_id}:*") == []


def test_the_producer_holds_rollouts_to_the_runs_limits(client, run_id):
    huge = rollout("h1", "g", 1.0, num_input_tokens=10, num_output_tokens=300_000)
    with pytest.raises(RolloutRejected, match="input_ids: length 300010 exceeds seq_len 2048"):
        RolloutProducer(client, run_id).produce([huge])
    settings = RunSettings(run_id=run_id, seq_len=512, vocab_size=500)
    with pytest.raises(RolloutRejected, match="input_ids: length 600 exceeds seq_len 512"):
        RolloutProducer.for_run(client, settings).produce([rollout("h2", "g", 1.0, num_output_tokens=596)])
    with pytest.raises(RolloutRejected, match=r"input_ids: token id \d+ outside \[0, 500\)"):
        RolloutProducer.for_run(client, settings).produce([rollout("h3", "g", 1.0, num_output_tokens=400)])
    assert client.keys(f"rlship:{run_id}:*") == []
