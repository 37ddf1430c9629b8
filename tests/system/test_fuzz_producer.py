"""Fuzzed calls (issue 38) through the real `RolloutProducer` of a run whose settings Redis
holds (`for_run`): fuzzed arrays and records, a group cut short or of another env, an id
already written. A refused call leaves nothing of itself in Redis (no partial write); an
accepted one writes exactly its rollouts: its records, payload keys and held bytes."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest
import redis
from hypothesis import example

from orchestrator.producer import AdmissionRefused, RolloutProducer, RolloutRejected
from orchestrator.records import InvalidRecord, RolloutRecord
from orchestrator.resume import stored_form
from orchestrator.settings import RunSettings
from tests.support.fuzz import FUZZ_INPUTS, fuzz, record_fields, rollout_arrays
from transport.keys import RunKeys
from transport.store import PayloadStore

CALLS = FUZZ_INPUTS  # each call a few Redis round trips: the oracle reads only what it could write


@pytest.fixture(scope="module")
def producer(redis_url: str) -> Iterator[RolloutProducer]:
    """The producer of a run with stored settings (groups of two, env math only); the run's
    keys expire after the module."""
    client = redis.Redis.from_url(redis_url)
    settings = RunSettings(
        run_id=f"test-fuzz-{uuid.uuid4().hex[:8]}", redis_url=redis_url, group_size=2, batch_size=4,
        envs=["math"], max_outstanding_rollouts=100_000,
    )  # fmt: skip
    client.set(RunKeys(settings.run_id).settings, stored_form(settings))
    yield RolloutProducer.for_run(client, settings.run_id)
    PayloadStore(client, settings.run_id).expire_run(3600)


@pytest.fixture(scope="module")
def written() -> list[str]:
    """The ids the fuzzed calls wrote, in order (a later call repeats the first)."""
    return []


def _rollout(rng: random.Random, group: str) -> tuple[RolloutRecord, dict] | None:
    """A fuzzed rollout of `group` (a fresh id), or None if its fuzzed record does not build
    (the record fuzz test covers that)."""
    tokens, arrays = rollout_arrays(rng)
    fields = record_fields(rng) if rng.random() < 0.3 else {}
    fields = {
        "task_id": "t", "env": rng.choice(["math", "math", "code"]), "policy_version": 0, "reward": 1.0,
        "num_input_tokens": tokens // 2, "num_output_tokens": tokens - tokens // 2, **fields,
        "rollout_id": f"r{rng.getrandbits(64):x}", "group_id": group,
    }  # fmt: skip
    try:
        return RolloutRecord(**fields), arrays
    except InvalidRecord:
        return None


def _call(rng: random.Random) -> tuple[list, bool, bool]:
    """One call: one rollout or a group of one to three (the run's groups are two), whole
    or not (`partial_groups`); whether its first id is to be one already written."""
    group = f"g{rng.getrandbits(64):x}"
    rollouts = [r for _ in range(rng.choice([1, 2, 2, 3])) if (r := _rollout(rng, group)) is not None]
    return rollouts, rng.random() < 0.5, rng.random() < 0.1


def _last_entry(client: redis.Redis, keys: RunKeys) -> bytes:
    last = client.xrevrange(keys.rollout_stream, count=1)
    return last[0][0] if last else b"0-0"


def _held(client: redis.Redis, keys: RunKeys, ids: list[str], after: bytes) -> tuple:
    """What Redis holds that a call of `ids` could have written: the stream's records after
    entry `after`, which of the ids have a payload key and a held-bytes field, and the run's
    held-bytes count and total (read in one round trip, whatever the run already holds)."""
    pipe = client.pipeline(transaction=False)
    pipe.xrange(keys.rollout_stream, min=b"(" + after)
    for rollout_id in ids:
        pipe.exists(keys.rollout(rollout_id))
    pipe.hlen(keys.held_bytes)
    pipe.get(keys.held_bytes_total)
    if ids:
        pipe.hmget(keys.held_bytes, ids)
    entries, *found = pipe.execute()
    records = [RolloutRecord.model_validate_json(fields[b"record"]).rollout_id for _, fields in entries]
    payloads = {rollout_id for rollout_id, there in zip(ids, found, strict=False) if there}
    held = {rollout_id for rollout_id, size in zip(ids, found[-1] if ids else [], strict=True) if size}
    return records, payloads, held, found[len(ids)], found[len(ids) + 1]


DUPLICATE = "rollout_id: already stored for this run"


@fuzz(batch=10, inputs=CALLS, calls=_call)
@example(calls=[([], False, False)])  # an empty call: ZeroDivisionError in the byte budget's check
def test_a_refused_call_writes_nothing_and_an_accepted_one_exactly_its_rollouts(producer, written, calls):
    """Refused ids already stored are the one refusal that writes the rest of the call (it is
    found in the one script that writes: the refusal says so); any other writes nothing."""
    client, keys = producer.client, producer.keys
    for rollouts, partial, again in calls:
        if rollouts and again and written:
            record, arrays = rollouts[0]
            rollouts[0] = record.model_copy(update={"rollout_id": written[0]}), arrays
        ids = [record.rollout_id for record, _ in rollouts]
        after = _last_entry(client, keys)
        before = _held(client, keys, ids, after)
        try:
            producer.produce(rollouts, partial_groups=partial)
        except (RolloutRejected, AdmissionRefused) as refused:
            problems = getattr(refused, "problems", {})
            if not problems or not all(p.startswith(DUPLICATE) for p in problems.values()):
                assert _held(client, keys, ids, after) == before, refused
                continue
            ids = [i for i in ids if i not in problems]
        records, payloads, held, count, _ = _held(client, keys, ids, after)
        assert records == ids, "the call's records, in order, after the stream's last one before it"
        assert payloads == held == set(ids) and not before[1] & set(ids)
        assert int(count) == int(before[3]) + len(ids)
        written.extend(ids)
