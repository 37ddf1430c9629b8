"""Fuzzed records (issue 38): a producer's `RolloutRecord` built from any JSON-ish values,
and the stream entries the orchestrator reads (`Ingest.take_record`: any `record` and
`facts` bytes). Each is taken or refused by one error naming the field and the value, never
a crash."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis
from hypothesis import example

from orchestrator.ingest import Ingest
from orchestrator.records import IDENTIFIER, InvalidRecord, RolloutRecord
from orchestrator.rollout_log import RolloutLog
from orchestrator.settings import RunSettings
from tasks.stages.finalize import PayloadFacts
from tests.support.fuzz import (
    RECORD_FIELDS,
    facts_bytes,
    fuzz,
    good_record_fields,
    logged,
    names_one_of,
    record_bytes,
    record_fields,
)


@fuzz(records=record_fields)
def test_a_record_from_any_values_is_built_or_refused_naming_each_field(records):
    for fields in records:
        try:
            record = RolloutRecord(**fields)
        except InvalidRecord as refused:
            message = str(refused)
            assert message.startswith("RolloutRecord: ") and "\n" not in message
            assert names_one_of(message.removeprefix("RolloutRecord: "), {*RECORD_FIELDS, *fields}), message
            continue
        assert IDENTIFIER.fullmatch(record.rollout_id) and record.num_tokens >= 0


def _ingest() -> Ingest:
    """An ingest whose record intake is exercised directly (its client is never called)."""
    settings = RunSettings(run_id="fuzz", group_size=2, batch_size=4, envs=["math"])
    return Ingest(
        settings, aioredis.Redis(), RolloutLog(None), asyncio.Event(), asyncio.Event(), lambda: 0, dict
    )


INGEST = _ingest()
GOOD = json.dumps(good_record_fields()).encode()


@fuzz(entries=lambda rng: (record_bytes(rng), facts_bytes(rng)))
@example(entries=[(b"[" * 100_000 + b"]" * 100_000, None)])  # json.loads: RecursionError
@example(entries=[(GOOD, b"\xff 1 2")])  # facts not UTF-8: UnicodeDecodeError
def test_a_stream_entry_is_taken_or_rejected_naming_the_field(entries):
    """Any `record` bytes beside any `facts`: counted as arrived, then taken (its facts kept
    only if they parse) or rejected once, logged naming the field; released ids are ids."""
    ingest = INGEST
    for raw, facts in entries:
        arrived, rejected = ingest.accounting.arrived, sum(ingest.accounting.rejected.values())
        with logged("rlship.orchestrator") as messages:
            released = ingest.take_record("1-0", raw, facts)
        assert ingest.accounting.arrived == arrived + 1
        assert all(isinstance(r, str) and IDENTIFIER.fullmatch(r) for r in released)
        if sum(ingest.accounting.rejected.values()) == rejected:
            assert messages == []
            assert all(isinstance(f, PayloadFacts) for f in ingest.open_facts.values())
            continue
        (message,) = messages
        reason, _, problem = message.removeprefix("rollout record rejected (").partition("): ")
        assert reason in ingest.accounting.rejected, message
        try:
            keys = set(json.loads(raw))
        except (ValueError, TypeError, RecursionError):
            keys = set()
        assert names_one_of(problem, {*RECORD_FIELDS, "<record>", *map(str, keys)}), message


@fuzz(entries=facts_bytes)
def test_facts_parse_or_are_none(entries):
    """A stream entry's facts that do not parse are none (finalize then reads the arrays)."""
    for facts in entries:
        parsed = PayloadFacts.from_wire(facts)
        if parsed is not None:
            assert parsed.loss_tokens >= 0 and parsed.payload_bytes > 0 and parsed.segments >= 0
            assert PayloadFacts.from_wire(parsed.to_wire()) == parsed
