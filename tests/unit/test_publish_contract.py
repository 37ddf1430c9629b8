"""The publish stage's record and its balance check, against sums done by hand, and the
payload checksum against xxHash's streaming state (`tests.support.checksums`)."""

from __future__ import annotations

import logging

import pytest

from tasks.publish import _stage_seconds
from tasks.stages.publish import build_record, conservation_error, running_totals
from tests.support.checksums import streamed_xxh3_128
from transport.checksum import payload_checksum

BALANCED = {
    "accounting/arrived": 21.0,
    "accounting/rejected": 1.0,
    "accounting/discarded": 2.0,
    "accounting/shipped": 10.0,
    "accounting/dropped_by_workers": 3.0,
    "accounting/pending": 4.0,
    "accounting/in_open_groups": 1.0,
}


def test_a_balanced_record_passes() -> None:
    assert conservation_error(BALANCED) is None
    assert conservation_error({}) is None, "nothing arrived, nothing accounted"


@pytest.mark.parametrize("term", [k for k in BALANCED if k != "accounting/arrived"])
@pytest.mark.parametrize("delta", [1.0, -1.0])
def test_every_term_unbalances_either_way(term: str, delta: float) -> None:
    record = {**BALANCED, term: BALANCED[term] + delta}
    assert conservation_error(record) is not None, f"{term} {delta:+g}"


def test_a_missing_term_counts_as_zero_and_the_message_names_every_term() -> None:
    record = {k: v for k, v in BALANCED.items() if k != "accounting/pending"}
    assert conservation_error(record) == (
        "accounting/arrived 21 != rejected 1 + discarded 2 + shipped 10 + dropped_by_workers 3 + pending 0"
        " + in_open_groups 1 = 17"
    )
    assert conservation_error({**BALANCED, "accounting/arrived": 22.5}) == (
        "accounting/arrived 22.5 != rejected 1 + discarded 2 + shipped 10 + dropped_by_workers 3 + pending 4"
        " + in_open_groups 1 = 21"
    )


def test_running_totals_add_this_step() -> None:
    progress = {
        "progress/tokens": 100.0,
        "progress/input_tokens": 30.0,
        "progress/output_tokens": 70.0,
        "progress/rollouts": 4.0,
        "progress/tasks": 2.0,
        "progress/dropped_by_workers": 1.0,
    }
    first = running_totals({}, progress)
    assert first == {
        "tokens": 100.0,
        "input_tokens": 30.0,
        "output_tokens": 70.0,
        "rollouts": 4.0,
        "tasks": 2.0,
        "dropped_by_workers": 1.0,
        "steps": 1.0,
    }
    second = running_totals(first, progress)
    assert second == {
        "tokens": 200.0,
        "input_tokens": 60.0,
        "output_tokens": 140.0,
        "rollouts": 8.0,
        "tasks": 4.0,
        "dropped_by_workers": 2.0,
        "steps": 2.0,
    }
    assert all(type(v) is float for v in running_totals({"steps": 3}, progress).values())


TOTALS = {
    "tokens": 50.0,
    "input_tokens": 20.0,
    "output_tokens": 30.0,
    "rollouts": 10.0,
    "tasks": 5.0,
    "dropped_by_workers": 3.0,
    "steps": 2.0,
}
COUNTERS = {
    k: v for k, v in BALANCED.items() if k not in ("accounting/shipped", "accounting/dropped_by_workers")
}


def test_build_record_by_hand(caplog: pytest.LogCaptureFixture) -> None:
    metrics = {"train/agg/all/count": 7.0, **COUNTERS}
    with caplog.at_level(logging.ERROR, logger="rlship.publish"):
        record = build_record(5, metrics, {"pack": 0.25, "encode": 1}, 2.5, 0.75, TOTALS, names="rlship-1")
    assert record == {
        "train/agg/all/count": 7.0,
        **COUNTERS,
        "time/encode": 1.0,
        "time/pack": 0.25,
        "time/ship": 2.5,
        "time/wait_for_policy": 0.75,
        **{f"progress/total_{k}": v for k, v in TOTALS.items()},
        "accounting/shipped": 10.0,
        "accounting/dropped_by_workers": 3.0,
        # prime-rl's names of the same quantities (tasks.stages.prime_names)
        "progress/total_samples": 10.0,
        "progress/total_problems": 5.0,
        "time/wait_for_ckpt": 0.75,
        "step": 5.0,
        "accounting/balanced": 1.0,
    }
    assert all(type(v) is float for v in record.values())
    assert caplog.records == []


@pytest.mark.parametrize("arrived", [20.0, 22.0])
def test_build_record_flags_and_logs_an_unbalanced_record(
    arrived: float, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = {**COUNTERS, "accounting/arrived": arrived}
    with caplog.at_level(logging.ERROR, logger="rlship.publish"):
        record = build_record(6, metrics, {}, 0.0, 0.0, TOTALS, names="rlship-1")
    assert record["accounting/balanced"] == 0.0
    [entry] = caplog.records
    assert entry.levelno == logging.ERROR
    assert entry.getMessage().startswith(
        f"step 6: the record's accounting does not add up: accounting/arrived {arrived:g} != "
    )


# XXH3-128 of no bytes, as the xxHash project publishes it (`xxhsum -H2` of an empty file).
EMPTY_XXH128 = "99aa06d3014798d86001c324468d497f"


def test_checksum_of_nothing_is_xxh3_128s_published_value() -> None:
    assert payload_checksum(b"") == EMPTY_XXH128


# Sizes across XXH3's code paths: 1-3, 4-8, 9-16, 17-128, 129-240 bytes, stripes, blocks.
@pytest.mark.parametrize("size", [1, 3, 8, 16, 17, 128, 240, 241, 1024, 1 << 20])
def test_checksum_is_xxh3_128_of_the_whole_payload(size: int) -> None:
    payload = bytes((i * 7 + 3) % 256 for i in range(size))
    expected = streamed_xxh3_128(payload)
    assert len(expected) == 32
    assert payload_checksum(payload) == expected
    assert payload_checksum(bytearray(payload)) == expected
    assert payload_checksum(memoryview(payload)) == expected
    changed_last = payload[:-1] + bytes([payload[-1] ^ 1])
    assert payload_checksum(changed_last) != expected, "every byte counts, the last one too"


def test_stage_seconds_take_the_slowest_rank() -> None:
    times = {b"encode:0": b"0.5", b"encode:1": b"1.5", b"encode:2": b"1", b"pack": b"0.25", b"send:1": b"0"}
    assert _stage_seconds(times) == {"encode": 1.5, "pack": 0.25, "send": 0.0}
    assert _stage_seconds({}) == {}
