"""The orchestrator's own decisions, against the real Redis: what it releases at once,
what it refuses to cut, and where policy-wait time is reported."""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.ingest import Ingest
from orchestrator.orchestrator import Orchestrator
from orchestrator.producer import RolloutProducer
from orchestrator.records import RecordRejected, parse_record
from orchestrator.rollout_log import RolloutLog
from orchestrator.settings import RunSettings
from tests.support.factories import group, rollout
from tests.support.shiprun import ship_settings, start_trainers, stop
from transport.keys import RunKeys
from transport.store import PayloadStore

pytestmark = pytest.mark.timeout(120)


async def _until(predicate, timeout: float = 30.0) -> None:
    """Until `predicate()` (a bool, or an awaitable of one) holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not (await result if inspect.isawaitable(result := predicate()) else result):
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def _settings(run_id: str, redis_url: str, tmp_path, **overrides) -> RunSettings:
    values = {
        "run_id": run_id,
        "redis_url": redis_url,
        "steps": 1,
        "batch_size": 4,
        "group_size": 2,
        "seq_len": 64,
        "output_dir": tmp_path,
        "max_off_policy_steps": 2,
        "trainers": "external",  # no gate: these tests drive the steps themselves
        "first_step": 0,  # and number them from 0 (tests/system/test_numbering.py covers prime-rl's 1)
    }
    return RunSettings(**{**values, **overrides})


async def _ingest(orchestrator: Orchestrator, records: int) -> None:
    task = asyncio.create_task(orchestrator.ingest.run())
    try:

        async def done() -> bool:
            return orchestrator.ingest.accounting.arrived >= records

        await _until(done)
    finally:
        task.cancel()


def test_discarded_rollouts_are_released_at_once_and_counted(client, redis_url, run_id, tmp_path):
    settings = _settings(run_id, redis_url, tmp_path)
    rollouts = [
        *group("zero", [1.0, 1.0], policy_version=3),
        *group("live", [1.0, 0.0], policy_version=3),
        *group("err", [1.0, 0.0], policy_version=3),
        *group("old", [1.0, 0.0], policy_version=0),
    ]
    errored, errored_arrays = rollout("err-r1", "err", 0.0, error="timeout", policy_version=3)
    rollouts[5] = (errored, errored_arrays)
    RolloutProducer(client, run_id).produce(rollouts)
    client.xadd(f"rlship:{run_id}:rollouts", {"record": b'{"rollout_id": "junk", "reward": "NaN"}'})

    async def scenario() -> Orchestrator:
        aclient = aioredis.Redis.from_url(redis_url)
        orchestrator = Orchestrator(settings, aclient)
        orchestrator.dispatcher.next_step = 3  # policy version 0 is now 3 steps behind: stale (limit 2)
        try:
            await _ingest(orchestrator, len(rollouts) + 1)
        finally:
            await aclient.aclose()
        return orchestrator

    orchestrator = asyncio.run(scenario())
    keys = RunKeys(run_id)
    alive = {r.rollout_id for r, _ in rollouts if client.exists(keys.rollout(r.rollout_id))}
    assert alive == {"live-r0", "live-r1"}, "only the trainable payloads are still held"
    # So are only their bytes, for the producers' budget: each blob's as Redis stores it.
    held = {k.decode(): int(v) for k, v in client.hgetall(keys.held_bytes).items()}
    assert held == {rid: client.strlen(keys.rollout(rid)) for rid in alive}
    assert int(client.get(keys.held_bytes_total)) == sum(held.values())
    assert orchestrator.ingest.pending.rollout_ids == ["live-r0", "live-r1"]
    # err-r0 is alone in its group's baseline once err-r1 errored: zero advantage.
    assert dict(orchestrator.ingest.accounting.discarded) == {"zero_advantage": 3, "error": 1, "stale": 2}
    assert dict(orchestrator.ingest.accounting.rejected) == {"invalid_field": 1}
    window = orchestrator.ingest.window.build()
    assert len(window) == 8, "every finalized rollout keeps its scalars for `all`"
    assert sorted(window.labels["error"]) == ["", "", "", "", "", "", "", "timeout"]
    assert window.numeric["is_trainable"].sum() == 2
    PayloadStore(client, run_id).delete_all_rollouts()


def test_trainable_payloads_stay_until_shipped(client, redis_url, run_id, tmp_path):
    settings = _settings(run_id, redis_url, tmp_path)
    rollouts = [*group("a", [1.0, 0.0]), *group("b", [0.0, 0.0])]
    RolloutProducer(client, run_id).produce(rollouts)

    async def scenario() -> Orchestrator:
        aclient = aioredis.Redis.from_url(redis_url)
        orchestrator = Orchestrator(settings, aclient)
        try:
            await _ingest(orchestrator, 4)
        finally:
            await aclient.aclose()
        return orchestrator

    orchestrator = asyncio.run(scenario())
    keys = RunKeys(run_id)
    assert orchestrator.ingest.pending.rollout_ids == ["a-r0", "a-r1"]
    assert client.exists(keys.rollout("a-r0"), keys.rollout("a-r1")) == 2
    assert client.exists(keys.rollout("b-r0"), keys.rollout("b-r1")) == 0
    PayloadStore(client, run_id).delete_all_rollouts()


def test_empty_batch_publishes_nothing_and_does_not_advance(client, redis_url, run_id, tmp_path):
    settings = _settings(run_id, redis_url, tmp_path)
    RolloutProducer(client, run_id).produce([*group("z1", [1.0, 1.0]), *group("z2", [0.0, 0.0])])

    async def scenario() -> None:
        aclient = aioredis.Redis.from_url(redis_url)
        orchestrator = Orchestrator(settings, aclient)
        try:
            await _ingest(orchestrator, 4)
            # Both groups have zero advantage: nothing is pending, so dispatch has nothing
            # to cut, and a cut forced now writes nothing.
            ingest = orchestrator.ingest
            assert len(ingest.pending) == 0 and ingest.accounting.discarded["zero_advantage"] == 4
            assert await orchestrator.dispatcher.cut(0) is None and orchestrator.dispatcher.next_step == 0
        finally:
            await aclient.aclose()

    asyncio.run(scenario())
    state = RunKeys(run_id)
    assert client.get(state.next_step) is None
    assert client.xlen(state.metrics_stream) == 0
    assert not list(client.scan_iter(match=state.step(0, "*")))


def test_policy_wait_is_in_the_held_steps_own_record(client, redis_url, run_id, workers, tmp_path):
    """The gate holds step 1 while step 0 is still in flight (no trainer reads yet): the wait
    is step 1's, in its record; step 0's record, published after the wait, has none of it."""
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=2, batch_size=4, group_size=2, first_step=0,
        max_async_level=1, policy_source="broadcasts",  # the test announces version 0 itself
    )  # fmt: skip
    RolloutProducer(client, run_id).produce(
        [
            *group("s0a", [1.0, 0.0]),
            *group("s0b", [0.0, 1.0]),
            *group("s1a", [1.0, 0.0]),
            *group("s1b", [0.0, 1.0]),
        ]
    )
    state = RunKeys(run_id)
    held_seconds = 1.5

    async def scenario() -> tuple[list[dict], float]:
        aclient = aioredis.Redis.from_url(redis_url)
        orchestrator = Orchestrator(settings, aclient)
        started = asyncio.get_running_loop().time()  # the gate cannot hold a step before this
        run = asyncio.create_task(orchestrator.run())
        trainers = []

        async def cut(step: int) -> bool:
            return int(await aclient.get(state.next_step) or 0) > step

        try:
            await _until(lambda: cut(0))
            await asyncio.sleep(held_seconds)
            assert not await cut(1), "step 1 waits for version 0"
            stable = Path(settings.broadcast_dir, "step_0", "STABLE")
            stable.parent.mkdir(parents=True)
            stable.touch()
            await _until(lambda: cut(1))
            held = asyncio.get_running_loop().time() - started  # the wait ended before step 1's cut
            assert not await aclient.hexists(state.published, 0), "step 0 is published after the wait"
            trainers = start_trainers(settings)
            await asyncio.wait_for(run, 60)
            return list(orchestrator.follower.records), held
        finally:
            run.cancel()
            stop(trainers)
            await aclient.aclose()

    records, held = asyncio.run(scenario())
    assert [int(r["step"]) for r in records] == [0, 1]
    assert records[0]["time/wait_for_policy"] == 0.0
    assert held_seconds / 2 <= records[1]["time/wait_for_policy"] <= held
    assert "time/wait_for_ckpt" not in records[1], "prime-rl 0002457f's name: rlship-1 only"


def test_bad_records_are_rejected_naming_field_and_value():
    good = rollout("ok", "g", 1.0)[0].model_dump()
    with pytest.raises(RecordRejected, match=r"reward: .*finite.*got nan") as info:
        parse_record(json.dumps({**good, "reward": float("nan")}))
    assert info.value.reason == "invalid_field"
    with pytest.raises(RecordRejected, match=r"num_output_tokens: .*greater than or equal to 0.*got -3"):
        parse_record(json.dumps({**good, "num_output_tokens": -3}))
    with pytest.raises(RecordRejected, match=r"env: Field required"):
        parse_record(json.dumps({k: v for k, v in good.items() if k != "env"}))
    with pytest.raises(RecordRejected, match=r"rollout_id: String should match pattern.*got 'a:b'"):
        parse_record(json.dumps({**good, "rollout_id": "a:b"}))
    with pytest.raises(RecordRejected) as info:
        parse_record(b"{not json")
    assert info.value.reason == "invalid_json"


def test_redis_client_fixture_is_real(client: redis.Redis):
    assert client.ping()


def test_accounted_with_a_cut_in_it_waits_for_the_cuts_write(client, redis_url, run_id, tmp_path):
    """Producers' admission reads `accounted` and `next_step` apart: while a cut is taken
    and its transaction (the new next step) has not landed, ingest goes on reading and
    counting, but writes no `accounted` that holds the cut; it writes it after, with no new
    record to prompt it. (An `accounted` with the cut, read beside the old next step's room,
    let a producer overfill the room by a group.)"""
    settings = _settings(run_id, redis_url, tmp_path)
    keys = RunKeys(run_id)
    producer = RolloutProducer(client, run_id)
    for name in ("a", "b"):
        producer.produce(group(name, [1.0, 0.0]))

    async def scenario() -> None:
        aclient = aioredis.Redis.from_url(redis_url)
        stopping, status = asyncio.Event(), {"pending": 0.0}
        log, work = RolloutLog(None), asyncio.Event()
        ingest = Ingest(settings, aclient, log, stopping, work, lambda: 0, status.copy)
        reading = asyncio.create_task(ingest.run())
        try:
            await _until(lambda: len(ingest.pending) == 4)
            await _until(lambda: client.get(keys.accounted) is not None)
            written = int(client.get(keys.accounted))
            async with ingest.cutting():
                ingest.take(4)
                producer.produce(group("c", [1.0, 1.0]))  # no signal: discarded, accounted at once
                await _until(lambda: ingest.accounting.accounted == written + 4 + 2)
                await _until(lambda: client.xlen(keys.rollout_stream) == 6 and not ingest.groups)
                for _ in range(2):  # two whole turns of ingest after the discards were counted
                    client.delete(keys.status)  # each turn writes it after its `accounted`
                    await _until(lambda: client.exists(keys.status))
                assert int(client.get(keys.accounted)) == written, "the cut's rollouts before its write"
            # Written once the cut is (here by ingest's next turn: no record comes to prompt it).
            await _until(lambda: int(client.get(keys.accounted)) == written + 6, timeout=5)
        finally:
            stopping.set()
            await reading
            await aclient.aclose()

    asyncio.run(scenario())
    PayloadStore(client, run_id).delete_all_rollouts()
