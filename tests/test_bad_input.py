"""Bad input costs one rollout, never the run: fuzzed stream records and producer calls
are rejected with an error naming the field and the value, counted, and logged once; good
rollouts beside them are unaffected; workers refuse anything but msgpack/json."""

from __future__ import annotations

import json
import logging
import math
import time

import numpy as np
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.loop import Orchestrator
from orchestrator.producer import RolloutProducer, RolloutRejected
from orchestrator.records import RolloutRecord
from orchestrator.settings import RunSettings
from tasks.app import app
from tasks.ship import RunState
from tests.factories import group, rollout

GOOD = rollout("good", "g", 1.0)[0].model_dump()
FIELDS = sorted(GOOD)
NASTY_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.floats()),
)


@st.composite
def bad_records(draw) -> bytes:
    """A valid record with fields removed, replaced by nasty values, or added; or garbage."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=60))
    record = dict(GOOD, rollout_id=f"fz{draw(st.integers(0, 10**9))}")
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        if draw(st.booleans()):
            del record[name]
        else:
            record[name] = draw(NASTY_VALUES)
    if draw(st.integers(0, 5)) == 0:
        record[draw(st.text(min_size=1, max_size=8))] = 1
    return json.dumps(record, allow_nan=True).encode()


def _orchestrator(**overrides) -> Orchestrator:
    """An orchestrator whose record intake is exercised directly (no Redis call is made)."""
    values = {"run_id": "fuzz", "group_size": 2, "batch_size": 4, "envs": ["math"]} | overrides
    return Orchestrator(RunSettings(**values), aioredis.Redis())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=bad_records())
def test_a_fuzzed_record_is_rejected_or_accepted_never_crashes(raw, caplog):
    orchestrator = _orchestrator()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlship.orchestrator"):
        orchestrator._take_record("1-0", raw)
    rejected = sum(orchestrator.accounting.rejected.values())
    try:
        RolloutRecord.model_validate_json(raw)
        valid = True
    except ValueError:
        valid = False
    if valid and json.loads(raw)["env"] == "math":
        assert rejected == 0
    else:
        assert rejected == 1, raw
        (message,) = [r.getMessage() for r in caplog.records]  # logged once
        assert "rejected" in message and ": " in message


def test_bad_records_beside_a_group_leave_it_whole(caplog):
    orchestrator = _orchestrator()
    members = [r for r, _ in group("g1", [1.0, 0.0], env="math")]
    feed = [
        members[0].model_dump_json().encode(),
        json.dumps({**GOOD, "rollout_id": "x1", "group_id": "g1", "reward": "NaN"}).encode(),
        json.dumps({**GOOD, "rollout_id": "x2", "group_id": "g1", "env": "unknown"}).encode(),
        members[0].model_dump_json().encode(),  # duplicate rollout id
        members[1].model_dump_json().encode(),
        rollout("g1-r9", "g1", 1.0, env="math")[0].model_dump_json().encode(),  # the group is complete
    ]
    with caplog.at_level(logging.WARNING, logger="rlship.orchestrator"):
        released = [orchestrator._take_record(f"{i + 1}-0", raw) for i, raw in enumerate(feed)]
    assert orchestrator.pending.rollout_ids == ["g1-r0", "g1-r1"], "the good group trains"
    assert dict(orchestrator.accounting.rejected) == {
        "invalid_field": 1, "unknown_env": 1, "duplicate_rollout": 1, "group_overflow": 1,
    }  # fmt: skip
    assert released[3] == [], "a duplicate's payload belongs to the original: kept"
    messages = [r.getMessage() for r in caplog.records]
    assert any("reward: Input should be a finite number (got 'NaN')" in m for m in messages)
    assert any("env: 'unknown' is not one of the run's envs ['math']" in m for m in messages)
    assert any("rollout_id: 'g1-r0' already received" in m for m in messages)
    assert len(messages) == 4


@st.composite
def bad_arrays(draw):
    record, arrays = rollout("p1", "g", 1.0, num_input_tokens=3, num_output_tokens=5)
    kind = draw(st.sampled_from(["length", "negative", "huge", "nan", "inf", "missing", "dtype", "too_long"]))
    if kind == "length":
        arrays[draw(st.sampled_from(["input_ids", "loss_mask", "inference_logprobs"]))] = np.zeros(7)
    elif kind in ("negative", "huge"):
        arrays["input_ids"] = arrays["input_ids"].astype(np.int64)
        arrays["input_ids"][draw(st.integers(0, 7))] = -1 if kind == "negative" else 2**40
    elif kind in ("nan", "inf"):
        arrays["inference_logprobs"] = arrays["inference_logprobs"].copy()
        arrays["inference_logprobs"][draw(st.integers(0, 7))] = math.nan if kind == "nan" else -math.inf
    elif kind == "missing":
        del arrays[draw(st.sampled_from(["input_ids", "loss_mask", "inference_logprobs"]))]
    elif kind == "dtype":
        arrays["loss_mask"] = arrays["loss_mask"].astype(np.float32)
    else:
        record = rollout("p1", "g", 1.0, num_input_tokens=3, num_output_tokens=600)[0]
        arrays = rollout("p1", "g", 1.0, num_input_tokens=3, num_output_tokens=600)[1]
    return kind, record, arrays


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=bad_arrays())
def test_the_producer_refuses_bad_arrays_and_writes_nothing(case, client, run_id):
    kind, record, arrays = case
    producer = RolloutProducer(client, run_id, max_tokens=512, vocab_size=151_936)
    good = rollout("p0", "g", 0.0)
    with pytest.raises(RolloutRejected) as info:
        producer.produce([good, (record, arrays)])
    assert list(info.value.problems) == ["p1"]
    field = info.value.problems["p1"].split(":")[0]
    assert field in ("input_ids", "loss_mask", "inference_logprobs"), info.value.problems
    assert client.exists(producer.keys.rollout("p0"), producer.keys.rollout("p1")) == 0
    assert client.xlen(producer.keys.rollout_stream) == 0, f"{kind}: nothing written"


@pytest.mark.timeout(60)
def test_workers_refuse_pickle(client, run_id, workers):
    """A pickled task is refused by the worker (never deserialized); a msgpack one runs."""
    released = RunState(run_id).released
    app.send_task("rlship.release", args=(run_id, 0, 1, 8), queue=workers.cpu_queue, serializer="pickle")
    app.send_task("rlship.release", args=(run_id, 1, 1, 8), queue=workers.cpu_queue)
    deadline = time.monotonic() + 30
    while not client.hexists(released, 1):
        assert time.monotonic() < deadline, "the msgpack task did not run"
        time.sleep(0.05)
    time.sleep(0.5)  # the pickled message came first; it has been refused by now
    assert not client.hexists(released, 0)
