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
from tests.support.fuzz import fuzz, record_fields, rollout_arrays
from transport.keys import RunKeys
from transport.store import PayloadStore

CALLS = 300  # each a Redis round trip or two: about 10 s


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


def _held(client: redis.Redis, keys: RunKeys) -> tuple:
    """What of the run Redis holds: its records, payload keys and held bytes."""
    records = [fields[b"record"] for _, fields in client.xrange(keys.rollout_stream)]
    payloads = set(client.scan_iter(match=keys.rollout("*"), count=1000))
    return records, payloads, client.hgetall(keys.held_bytes), client.get(keys.held_bytes_total)


DUPLICATE = "rollout_id: already stored for this run"


@fuzz(batch=10, inputs=CALLS, calls=_call)
@example(calls=[([], False, False)])  # an empty call: ZeroDivisionError in the byte budget's check
def test_a_refused_call_writes_nothing_and_an_accepted_one_exactly_its_rollouts(producer, calls):
    """Refused ids already stored are the one refusal that writes the rest of the call (it is
    found in the one script that writes: the refusal says so); any other writes nothing."""
    client, keys = producer.client, producer.keys
    for rollouts, partial, again in calls:
        written = client.hkeys(keys.held_bytes)
        if rollouts and again and written:
            record, arrays = rollouts[0]
            rollouts[0] = record.model_copy(update={"rollout_id": written[0].decode()}), arrays
        ids = [record.rollout_id for record, _ in rollouts]
        records, payloads, held, _ = before = _held(client, keys)
        try:
            producer.produce(rollouts, partial_groups=partial)
        except (RolloutRejected, AdmissionRefused) as refused:
            problems = getattr(refused, "problems", {})
            if not problems or not all(p.startswith(DUPLICATE) for p in problems.values()):
                assert _held(client, keys) == before, refused
                continue
            ids = [i for i in ids if i not in problems]
        now_records, now_payloads, now_held, _ = _held(client, keys)
        assert now_records[: len(records)] == records
        assert [RolloutRecord.model_validate_json(r).rollout_id for r in now_records[len(records) :]] == ids
        assert now_payloads - payloads == {keys.rollout(i).encode() for i in ids}
        assert set(now_held) - set(held) == {i.encode() for i in ids}
