"""A producer made for a run checks its rollouts against the run's own settings, stored in
Redis by the run's orchestrator, so the run never drops at the cut what the producer took
for its own limits; what the workers still drop (a rollout written by other code) is
visible to the producer (`outcome`), in the record and on the Prometheus endpoint; a
finished run takes nothing. Real Redis, Celery workers, trainer ranks and orchestrator.

The oracle is the test's own choices: the limits it gave the run, the rollouts it made too
long or out of vocabulary, the group it damaged behind the producer's back, the group it
gave equal rewards."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from orchestrator.admission import AdmissionRefused
from orchestrator.producer import AsyncRolloutProducer, RolloutProducer, RolloutRejected
from orchestrator.settings import RunSettings
from orchestrator.stored_settings import RunNotStarted, SettingsDisagree
from tests.support.factories import group
from tests.support.prometheus import scrape, serve_finished_run
from tests.support.shiprun import metrics_lines, ship, ship_settings
from transport.arrays_blob import pack_arrays
from transport.keys import RunKeys
from transport.outcomes import cut_into, dropped_at, record_outcomes
from transport.store import PayloadStore

GROUP = 4


def good_groups(prefix: str, count: int) -> list[list[tuple[Any, Any]]]:
    return [group(f"{prefix}{index}", [1.0, 0.0, 1.0, 0.0]) for index in range(count)]


@pytest.mark.timeout(240)
def test_a_producer_knows_its_run_and_learns_what_became_of_its_rollouts(
    client, redis_url, run_id, workers, tmp_path
):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=2, batch_size=8, group_size=GROUP, seq_len=64,
        vocab_size=1000, envs=["math"], transport="fs", max_off_policy_steps=100,
    )  # fmt: skip
    # Nothing stored yet: the run id alone is refused at once, naming the run and what to do.
    with pytest.raises(RunNotStarted, match=f"run {run_id} has no settings in Redis"):
        RolloutProducer.for_run(client, run_id)
    # A producer started before its run waits for the run's settings.
    made: list[RolloutProducer] = []
    waiting = threading.Thread(target=lambda: made.append(RolloutProducer.for_run(client, run_id, wait=60)))
    waiting.start()
    shipping: list[Any] = []
    run = threading.Thread(target=lambda: shipping.append(ship(settings, produce=False)))
    run.start()
    waiting.join(60)
    producer = made[0]

    # The run's limits, not the defaults (seq_len 2048, group_size 8, any env): each refused
    # at produce, naming the rollout, the field and the value; nothing of the call written.
    too_long = group("long", [1.0, 0.0, 1.0, 0.0], num_output_tokens=70)
    out_of_vocabulary = group("vocab", [1.0, 0.0, 1.0, 0.0])
    out_of_vocabulary[2][1]["input_ids"][0] = 1000
    alone = group("alone", [1.0])
    crowd = group("crowd", [1.0, 0.0, 1.0, 0.0, 1.0])
    other_env = group("code", [1.0, 0.0, 1.0, 0.0], env="code")
    int_logprobs = group("ints", [1.0, 0.0, 1.0, 0.0])
    int_logprobs[0][1]["inference_logprobs"] = np.zeros(10, dtype=np.int64)
    with pytest.raises(RolloutRejected) as refused:
        producer.produce([*too_long, *out_of_vocabulary, *alone, *crowd, *other_env, *int_logprobs])
    problems = refused.value.problems
    assert problems["long-r0"] == "input_ids: length 74 exceeds seq_len 64"
    assert problems["vocab-r2"] == "input_ids: token id 1000 outside [0, 1000)"
    assert "vocab-r0" not in problems
    assert problems["alone-r0"].startswith("group_id: 'alone' has 1 of the run's group_size 4 rollouts")
    assert (
        problems["crowd-r4"]
        == "group_id: 'crowd' has 5 rollouts in this call, more than the run's group_size 4"
    )
    assert problems["code-r1"] == "env: 'code' is not one of the run's envs ['math']"
    assert problems["ints-r0"].startswith("inference_logprobs: dtype int64, expected floats")
    assert client.hlen(RunKeys(run_id).held_bytes) == 0, "nothing of a refused call is written"
    # A group written in parts is taken when the call says so.
    parts = group("parts", [1.0, 0.0, 1.0, 0.0])
    producer.produce(parts[:2], timeout=30, partial_groups=True)
    producer.produce(parts[2:], timeout=30, partial_groups=True)
    # Float64 log-probabilities are taken (the wire carries float32), as the guide says.
    wide = group("wide", [1.0, 0.0, 1.0, 0.0])
    for _, arrays in wide:
        arrays["inference_logprobs"] = arrays["inference_logprobs"].astype(np.float64)
    producer.produce(wide, timeout=30)

    # Settings given that the run does not have are refused, naming each; the run's own
    # (or none but the id) are taken.
    with pytest.raises(SettingsDisagree) as disagree:
        RolloutProducer.for_run(client, RunSettings(run_id=run_id, seq_len=2048, group_size=GROUP))
    assert "seq_len: 64 in the run, 2048 given" in str(disagree.value)
    assert "group_size" not in str(disagree.value)
    assert RolloutProducer.for_run(client, RunSettings(run_id=run_id)).max_tokens == 64
    # What a resume may change is taken as given (the run being resumed has not stored it yet).
    resuming = RolloutProducer.for_run(
        client, RunSettings(run_id=run_id, steps=40, max_outstanding_rollouts=64)
    )
    assert resuming.admission is not None and resuming.admission.limit == 64 and resuming.max_tokens == 64

    # A group written by other code and damaged behind the producer's back: the workers
    # drop it at the cut; a group of equal rewards is discarded (no advantage).
    plain = RolloutProducer(client, run_id)
    damaged = group("damaged", [1.0, 0.0, 1.0, 0.0])
    plain.produce(damaged)
    store = PayloadStore(client, run_id)
    for record, arrays in damaged:
        short = {**arrays, "input_ids": arrays["input_ids"][:-1]}
        client.set(store.keys.rollout(record.rollout_id), pack_arrays(short), keepttl=True)
    equal = group("equal", [1.0, 1.0, 1.0, 1.0])
    producer.produce(equal, timeout=30)

    async def produce_async() -> None:
        async_client = aioredis.Redis.from_url(redis_url)
        try:
            async_producer = AsyncRolloutProducer.for_run(async_client, run_id)
            await async_producer.produce(good_groups("async", 1)[0], timeout=60)
            with pytest.raises(RolloutRejected, match="exceeds seq_len 64"):
                await async_producer.produce(group("along", [1.0, 0.0, 1.0, 0.0], num_output_tokens=70))
            outcome = await async_producer.outcome(["async0-r0"])
            assert outcome["async0-r0"].state in ("pending", "cut", "shipped")
        finally:
            await async_client.aclose()

    asyncio.run(produce_async())  # with the damaged group, the second step's batch
    run.join(180)
    assert not run.is_alive() and shipping, "the run shipped its two steps"

    outcome = producer.outcome([r.rollout_id for r, _ in [*parts, *wide, *damaged, *equal]] + ["never"])
    shipped_steps = {outcome[r.rollout_id].step for r, _ in [*parts, *wide]}
    assert {outcome[r.rollout_id].state for r, _ in [*parts, *wide]} == {"shipped"}
    assert shipped_steps <= {0, 1}
    for record, _ in damaged:
        got = outcome[record.rollout_id]
        assert got.state == "dropped" and got.step in (0, 1), got
        assert got.reason == "invalid_payload: input_ids: length 9, the record says 10 tokens", got
    assert {str(outcome[r.rollout_id]) for r, _ in equal} == {"discarded: zero_advantage"}
    assert outcome["never"].state == "unknown"

    # The drops are in the record and counted once each for the Prometheus endpoint.
    records = metrics_lines(settings)
    dropped = sum(r.get("progress/dropped_by_workers/input_ids", 0.0) for r in records)
    assert dropped == 4.0
    endpoint, port = serve_finished_run(shipping[0].orchestrator, settings)
    try:
        samples = scrape(port, run_id)
    finally:
        endpoint.close()
    outcomes = {name: value for name, value in samples.items() if name.startswith("rlship_rollouts_d")}
    assert outcomes == {
        "rlship_rollouts_dropped_total:input_ids": 4.0,
        "rlship_rollouts_discarded_total:zero_advantage": 4.0,
    }, outcomes

    # The run has finished: it takes nothing more, in one line.
    with pytest.raises(AdmissionRefused) as finished:
        producer.produce(good_groups("late", 1)[0])
    assert finished.value.reason == "finished" and not finished.value.passes
    assert str(finished.value).count("\n") == 0 and f"run {run_id} has finished" in str(finished.value)
    assert client.ttl(RunKeys(run_id).outcomes) > 0


def test_outcome_words_counts_and_horizon(client, run_id):
    """The outcome record on a real Redis: a rollout cut into a step reads as shipped once
    that step is published; a retried write counts nothing again; the oldest leave past
    the horizon."""
    keys = RunKeys(run_id)
    record_outcomes(
        client, keys, {"a": cut_into(3), "b": dropped_at(3, "invalid_payload: x: bad", "x")}, 10, 60
    )
    record_outcomes(client, keys, {"b": dropped_at(3, "invalid_payload: x: bad", "x")}, 10, 60)  # a retry
    producer = RolloutProducer(client, run_id)
    assert str(producer.outcome(["a"])["a"]) == "cut in step 3"
    client.hset(keys.published, "3", 1.0)
    assert str(producer.outcome(["a"])["a"]) == "shipped in step 3"
    assert str(producer.outcome(["b"])["b"]) == "dropped at the cut of step 3: invalid_payload: x: bad"
    assert client.hgetall(keys.outcome_counts) == {b"dropped/x": b"1"}
    record_outcomes(client, keys, {f"r{i}": cut_into(4) for i in range(12)}, 10, 60)
    assert client.hlen(keys.outcomes) == client.llen(keys.outcome_order) == 10
    assert client.hget(keys.outcomes, "a") is None and client.hget(keys.outcomes, "r11") is not None
    assert all(client.ttl(key) > 0 for key in (keys.outcomes, keys.outcome_order, keys.outcome_counts))
    client.delete(keys.outcomes, keys.outcome_order, keys.outcome_counts, keys.published)
