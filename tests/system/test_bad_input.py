"""Bad input costs one rollout, never the run: fuzzed stream records and producer calls
are rejected with an error naming the field and the value, counted, and logged once; good
rollouts beside them are unaffected; workers refuse anything but msgpack/json."""

from __future__ import annotations

import json
import logging
import math
import re
import time

import numpy as np
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.orchestrator import Orchestrator
from orchestrator.producer import RolloutProducer, RolloutRejected
from orchestrator.records import InvalidRecord, RolloutRecord
from orchestrator.settings import RunSettings
from tasks.app import app
from tests.support.factories import group, rollout
from transport.keys import RunKeys

GOOD = rollout("good", "g", 1.0)[0].model_dump()
TRACE = {"id": "t1", "num_input_tokens": 9, "num_output_tokens": 8, "num_total_tokens": 13, "num_branches": 2}
BRANCH = GOOD | {"episode_id": "e1", "trace": TRACE}  # a verifiers trace's branch
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
    """A valid record (plain, or a trace's branch) with fields removed, replaced by nasty
    values, or added; or garbage."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=60))
    record = dict(draw(st.sampled_from([GOOD, BRANCH])), rollout_id=f"fz{draw(st.integers(0, 10**9))}")
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


# The stream record's contract, written out here rather than taken from the pydantic model
# the orchestrator runs: field -> (required, check of the decoded JSON value).
IDENTIFIER_TEST = re.compile(r"[A-Za-z0-9_./-]{1,200}")


def _is_identifier(value: object) -> bool:
    return isinstance(value, str) and IDENTIFIER_TEST.fullmatch(value) is not None


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _is_number(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


CONTRACT = {
    "rollout_id": (True, _is_identifier),
    "group_id": (True, _is_identifier),
    "task_id": (True, _is_identifier),
    "env": (True, _is_identifier),
    "policy_version": (True, _is_count),
    "reward": (True, _is_number),
    "num_input_tokens": (True, _is_count),
    "num_output_tokens": (True, _is_count),
    "num_turns": (False, _is_count),
    "temperature": (False, lambda v: _is_number(v) and v > 0),
    "is_truncated": (False, lambda v: type(v) is bool),
    "error": (False, lambda v: v is None or _is_identifier(v)),
    "cancelled": (False, lambda v: type(v) is bool),
    "stop_condition": (False, lambda v: v is None or _is_identifier(v)),
    "agent": (False, lambda v: v is None or _is_identifier(v)),
    "metrics": (
        False,
        lambda v: isinstance(v, dict) and all(_is_identifier(k) and _is_number(x) for k, x in v.items()),
    ),
    "group_rollouts": (False, lambda v: v is None or (_is_count(v) and v >= 1)),
    "episode_id": (False, lambda v: v is None or _is_identifier(v)),
    "trace": (False, lambda v: v is None or _is_trace(v)),
}
TRACE_COUNTS = ("num_input_tokens", "num_output_tokens", "num_total_tokens", "num_branches")


def _is_trace(value: object) -> bool:
    """The trace a rollout is a branch of: its id and its counts, nothing else."""
    return (
        isinstance(value, dict)
        and set(value) == {"id", *TRACE_COUNTS}
        and _is_identifier(value["id"])
        and all(_is_count(value[name]) for name in TRACE_COUNTS)
    )


def acceptable(raw: bytes) -> bool:
    """Whether a run whose only env is `math` must take this stream record."""
    try:
        record = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(record, dict) or set(record) - CONTRACT.keys():
        return False
    for name, (required, check) in CONTRACT.items():
        if name not in record:
            if required:
                return False
        elif not check(record[name]):
            return False
    if record.get("trace") is not None and record.get("episode_id") is None:
        return False  # a trace is one of an episode
    return record["env"] == "math"


def test_the_contract_oracle_on_cases_written_out():
    assert acceptable(json.dumps(GOOD).encode())
    for change in ({"reward": True}, {"reward": "1"}, {"policy_version": 1.0}, {"is_truncated": 1},
                   {"temperature": 0}, {"metrics": {"t": True}}, {"error": ""}, {"env": "code"},
                   {"extra": 1}, {"rollout_id": "a b"}, {"reward": float("nan")}, {"group_rollouts": 0},
                   {"group_rollouts": True}, {"group_rollouts": 2.0}, {"trace": TRACE},
                   {"episode_id": "e", "trace": TRACE | {"num_branches": -1}},
                   {"episode_id": "e", "trace": TRACE | {"extra": 1}},
                   {"episode_id": "e", "trace": "t1"}):  # fmt: skip
        assert not acceptable(json.dumps({**GOOD, **change}).encode()), change
    assert acceptable(json.dumps({**GOOD, "episode_id": "e", "trace": TRACE}).encode())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=bad_records())
def test_a_fuzzed_record_is_rejected_or_accepted_never_crashes(raw, caplog):
    orchestrator = _orchestrator()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlship.orchestrator"):
        orchestrator.ingest.take_record("1-0", raw)
    rejected = sum(orchestrator.ingest.accounting.rejected.values())
    if acceptable(raw):
        assert rejected == 0, raw
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
        released = [orchestrator.ingest.take_record(f"{i + 1}-0", raw) for i, raw in enumerate(feed)]
    assert orchestrator.ingest.pending.rollout_ids == ["g1-r0", "g1-r1"], "the good group trains"
    assert dict(orchestrator.ingest.accounting.rejected) == {
        "invalid_field": 1, "unknown_env": 1, "duplicate_rollout": 1, "group_overflow": 1,
    }  # fmt: skip
    assert released[3] == [], "a duplicate's payload belongs to the original: kept"
    messages = [r.getMessage() for r in caplog.records]
    assert any("reward: Input should be a valid number (got 'NaN')" in m for m in messages)
    assert any("env: 'unknown' is not one of the run's envs ['math']" in m for m in messages)
    assert any("rollout_id: 'g1-r0' already received" in m for m in messages)
    assert len(messages) == 4


def test_a_record_built_with_a_bad_field_names_it_in_one_line():
    """The producer's side of the record: no raw pydantic error, one line per bad field."""
    fields = dict(GOOD, reward=math.nan, num_output_tokens=-1)
    with pytest.raises(InvalidRecord) as refused:
        RolloutRecord(**fields)
    assert str(refused.value) == (
        "RolloutRecord: reward: Input should be a finite number (got nan); "
        "num_output_tokens: Input should be greater than or equal to 0 (got -1)"
    )
    assert refused.value.__cause__ is None and isinstance(refused.value, ValueError)


@st.composite
def bad_arrays(draw):
    record, arrays = rollout("p1", "g", 1.0, num_input_tokens=3, num_output_tokens=5)
    kinds = ["length", "negative", "huge", "nan", "inf", "missing", "dtype", "unknown", "too_long"]
    kind = draw(st.sampled_from(kinds))
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
    elif kind == "unknown":  # a misspelt optional stream is refused, not stored and never used
        arrays["ref_logprob"] = np.zeros(8, dtype=np.float32)
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
    assert field in ("input_ids", "loss_mask", "inference_logprobs", "ref_logprob"), info.value.problems
    if kind == "unknown":
        assert "ref_logprob: not an array rlship carries (it carries input_ids, " in info.value.problems["p1"]
    assert client.exists(producer.keys.rollout("p0"), producer.keys.rollout("p1")) == 0
    assert client.xlen(producer.keys.rollout_stream) == 0, f"{kind}: nothing written"


@pytest.mark.timeout(60)
def test_workers_refuse_pickle(client, run_id, workers):
    """A pickled task is refused by the worker (never deserialized: it logs the refusal and
    drops the message); a msgpack one runs."""
    released = RunKeys(run_id).released
    app.send_task("rlship.release", args=(run_id, 0, 1, 8), queue=workers.cpu_queue, serializer="pickle")
    app.send_task("rlship.release", args=(run_id, 1, 1, 8), queue=workers.cpu_queue)

    def refusal_logged() -> bool:
        text = "".join(path.read_text(errors="replace") for path in workers.log_dir.glob("cpu-*.log"))
        return any(
            "Refusing to deserialize untrusted content of type pickle" in block and run_id in block
            for block in text.split("[20")
        )

    deadline = time.monotonic() + 30
    while not (client.hexists(released, 1) and refusal_logged()):
        assert time.monotonic() < deadline, "the msgpack task did not run, or the pickled one was not refused"
        time.sleep(0.05)
    assert not client.hexists(released, 0)
