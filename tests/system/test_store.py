"""The claim-check store against the real Redis (sync and asyncio clients)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis

from orchestrator.lease import Lease
from tests.support.factories import store_rollout_arrays
from transport.arrays_blob import PayloadCorruptError, pack_arrays, unpack_arrays
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys
from transport.store import AsyncPayloadStore, PayloadMissingError, PayloadStore


def _arrays(n: int = 10) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.arange(n, dtype=np.int32),
        "loss_mask": np.arange(n) % 2 == 0,
        "inference_logprobs": -np.linspace(0, 1, n, dtype=np.float32),
        "routed_experts": np.ones((n, 2, 3), dtype=np.uint8),
    }


def test_blob_is_compact_and_round_trips_zero_copy():
    arrays = _arrays(1000)
    blob = pack_arrays(arrays)
    assert len(blob) < sum(a.nbytes for a in arrays.values()) + 200, "raw bytes, not JSON lists"
    back = unpack_arrays(blob)
    for name, array in arrays.items():
        np.testing.assert_array_equal(back[name], array)
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
    assert not back["input_ids"].flags.writeable, "a view into the blob, not a copy"


def test_put_get_missing_and_corrupt(client, run_id):
    store = PayloadStore(client, run_id, ttl_seconds=600)
    store_rollout_arrays(client, run_id, {"a": _arrays(), "b": _arrays(4)})
    got = store.get_rollouts(["a", "b"])
    np.testing.assert_array_equal(got["b"]["input_ids"], np.arange(4))
    assert 0 < client.ttl(store.keys.rollout("a")) <= 600, "every write carries a TTL"
    with pytest.raises(PayloadMissingError, match=rf"'rlship:{run_id}:rollout:nope' is missing"):
        store.get_rollouts(["a", "nope"])
    client.set(store.keys.rollout("bad"), b"\xc1not msgpack")
    fetched = store.fetch_rollouts(["a", "nope", "bad"])
    assert isinstance(fetched["a"], dict)
    assert isinstance(fetched["nope"], PayloadMissingError)
    assert isinstance(fetched["bad"], PayloadCorruptError) and "rollout:bad" in str(fetched["bad"])
    store.delete_all_rollouts()


def test_delete_step_is_one_call_and_touches_only_its_run(client, run_id):
    mine = PayloadStore(client, run_id)
    other = PayloadStore(client, run_id + "-other")
    store_rollout_arrays(client, run_id, {"r1": _arrays()})
    store_rollout_arrays(client, run_id + "-other", {"r1": _arrays()})
    mine.put_payload(7, 0, b"rank0")
    mine.put_payload(7, 1, memoryview(b"rank1"))
    other.put_payload(7, 0, b"theirs")
    mine.put_step_value(7, "plan", b"plan")
    client.sadd(mine.keys.step_keys(7), mine.keys.rollout("r1"))
    assert mine.get_payload(7, 1) == b"rank1"
    assert mine.delete_step(7) == 2
    assert not client.exists(mine.keys.rollout("r1"), mine.keys.step(7, "plan"), mine.keys.step_keys(7))
    assert mine.get_payload(7, 0) == b"rank0", "payloads outlive the step until acknowledged"
    mine.release_payloads(ranks=2, through_step=7, evict_through=7)
    assert other.get_payload(7, 0) == b"theirs" and other.get_rollouts(["r1"])
    other.release_payloads(ranks=1, through_step=7, evict_through=7)
    other.delete_all_rollouts()
    with pytest.raises(PayloadMissingError):
        mine.get_payload(7, 0)


def test_payloads_are_retained_until_every_rank_acknowledges(client, run_id):
    store = PayloadStore(client, run_id)
    for step in range(4):
        for rank in range(2):
            store.put_payload(step, rank, b"%d:%d" % (step, rank))
    client.sadd(store.keys.trained(0), 0, 1)  # both ranks acknowledged step 0
    client.sadd(store.keys.trained(1), 0)  # only rank 0 acknowledged step 1
    client.sadd(store.keys.trained(3), 0, 1)  # step 3: acknowledged, but not yet released

    released = store.release_payloads(ranks=2, through_step=2, evict_through=-1)
    assert (released.steps, released.evicted_unacknowledged) == (1, [])
    assert not client.exists(store.keys.payload(0, 0), store.keys.payload(0, 1), store.keys.trained(0))
    assert store.get_payload(1, 1) == b"1:1" and store.get_payload(3, 0) == b"3:0"

    released = store.release_payloads(ranks=2, through_step=3, evict_through=1)
    assert (released.steps, released.evicted_unacknowledged) == (2, [1])
    assert store.get_payload(2, 0) == b"2:0", "unacknowledged inside the bound: kept"
    assert client.zrange(store.keys.retained_payloads, 0, -1) == [b"2"]
    store.release_payloads(ranks=2, through_step=3, evict_through=3)
    assert not client.exists(store.keys.retained_payloads, store.keys.payload(2, 1), store.keys.trained(1))


def test_async_store(client, redis_url, run_id):
    """The loop's store: it drops rollouts that cannot train and never reads their arrays."""
    store_rollout_arrays(client, run_id, {"x": _arrays(), "y": _arrays()})

    async def scenario() -> None:
        aclient = aioredis.Redis.from_url(redis_url)
        store = AsyncPayloadStore(aclient, run_id)
        try:
            assert await store.delete_rollouts(["y", "absent"]) == 1
            assert client.exists(store.keys.rollout("x")) and not client.exists(store.keys.rollout("y"))
            assert await store.delete_all_rollouts() == 1
            assert not client.exists(store.keys.rollout("x"))
        finally:
            await aclient.aclose()

    asyncio.run(scenario())


def test_expire_run_gives_every_key_the_run_keeps_its_time_and_leaves_short_lived_marks_alone(
    client, redis_url, run_id
):
    """What a run's end, and its lease every `RENEW_SECONDS` (from the start), apply: a key
    without an expiry and one expiring sooner get the time; one expiring later keeps it; a
    short-lived mark keeps its seconds (else a killed run's lease would hold its successor
    off for a day). Through the lease, as an orchestrator takes the run."""
    keys = RunKeys(run_id)
    client.set(keys.run_marker, 1)  # as an earlier version left it: no expiry
    client.set(keys.settings, "{}", ex=100)  # a paused run's keys, nearly expired
    client.sadd(keys.announced_ranks, 0)
    client.expire(keys.announced_ranks, 7 * DEFAULT_TTL_SECONDS)
    client.set(keys.ship_problem, "rank 1 not READY", ex=10)

    async def take_the_run() -> None:
        async_client = aioredis.Redis.from_url(redis_url)
        stopping = asyncio.Event()
        lease = Lease(async_client, run_id, stopping, on_lost=lambda exc: None, loss_report=dict)
        holding = asyncio.create_task(lease.hold())
        await lease.acquired.wait()
        stopping.set()
        await holding
        await async_client.aclose()

    asyncio.run(take_the_run())
    assert DEFAULT_TTL_SECONDS - 60 < client.ttl(keys.run_marker) <= DEFAULT_TTL_SECONDS
    assert DEFAULT_TTL_SECONDS - 60 < client.ttl(keys.settings) <= DEFAULT_TTL_SECONDS
    assert client.ttl(keys.announced_ranks) > DEFAULT_TTL_SECONDS
    assert 0 < client.ttl(keys.ship_problem) <= 10


def test_expire_run_leaves_a_fresh_key_untouched_so_a_watch_on_it_holds(client, run_id):
    """finalize WATCHes the step's manifest the cut has just written; the lease's renewal,
    running beside the first cut (it scans every key of a Redis that may hold tens of
    thousands), must not count as a write to it, or finalize takes its step for one found
    empty and the step stalls until `stall_seconds` (seen in the clean-clone runs)."""
    store = PayloadStore(client, run_id)
    manifest = store.keys.step(0, "manifest")
    client.set(manifest, b"cut", ex=DEFAULT_TTL_SECONDS)
    with client.pipeline(transaction=True) as pipe:
        pipe.watch(manifest)
        store.expire_run()
        pipe.multi()
        pipe.set(store.keys.step(0, "verdict"), b"ok", ex=60)
        assert pipe.execute() == [True], "the renewal broke the watch"
    assert DEFAULT_TTL_SECONDS - 60 < client.ttl(manifest) <= DEFAULT_TTL_SECONDS
    client.delete(manifest, store.keys.step(0, "verdict"))
