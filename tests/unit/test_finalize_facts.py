"""Finalize over a producer's facts (no arrays read): each case written out by hand, and a
property that the facts path and the arrays path agree on rollouts the producer accepted."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.cohort import NUMERIC_COLUMNS, CohortBuilder
from tasks.manifest import ShipConfig, StepManifest
from tasks.stages.finalize import (
    FACT_COLUMNS,
    PayloadFacts,
    check_rollout_arrays,
    finalize_step,
    rollouts_to_read,
    rollouts_with_facts,
)
from transport.arrays_blob import pack_arrays
from transport.store import PayloadMissingError

SEQ_LEN, VOCAB = 8, 100


def _manifest(rows: list[tuple[str, float, int, tuple[int, int, int] | None]]) -> StepManifest:
    """rows: (rollout_id, advantage, tokens, facts as (loss tokens, largest id, bytes) or None)."""
    builder = CohortBuilder()
    for rollout_id, advantage, tokens, facts in rows:
        numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {"advantage": advantage, "num_output_tokens": tokens}
        if facts is not None:
            numeric |= dict(zip(FACT_COLUMNS, facts, strict=True))
        builder.append(numeric, {"rollout_id": rollout_id})
    cohort = builder.build()
    config = ShipConfig(ranks=1, seq_len=SEQ_LEN, vocab_size=VOCAB)
    return StepManifest("unit", 3, 2, 0.0, config, cohort, cohort)


def test_the_wire_form_and_what_is_not_facts() -> None:
    assert PayloadFacts.from_wire(b"3 41 512") == PayloadFacts(3, 41, 512)
    assert PayloadFacts.from_wire(PayloadFacts(0, -1, 90).to_wire()) == PayloadFacts(0, -1, 90)
    # A fourth number: the rollout's segments of side arrays by handle.
    assert PayloadFacts(3, 41, 512, 2).to_wire() == "3 41 512 2"
    assert PayloadFacts.from_wire(b"3 41 512 2") == PayloadFacts(3, 41, 512, 2)
    assert PayloadFacts(3, 41, 512).to_wire() == "3 41 512"
    bad_ones = (None, b"", b"3 41", b"3 41 512 7 1", b"3 41 512 0", b"x 41 512", b"-1 41 512", b"3 41 0")
    for bad in bad_ones:
        assert PayloadFacts.from_wire(bad) is None, bad


def test_facts_of_checked_arrays() -> None:
    arrays = {"input_ids": np.array([5, 17, 2]), "loss_mask": np.array([False, True, True])}
    assert PayloadFacts.of(arrays, 77) == PayloadFacts(2, 17, 77)
    empty = {"input_ids": np.zeros(0, dtype=np.int64), "loss_mask": np.zeros(0, dtype=bool)}
    assert PayloadFacts.of(empty, 12) == PayloadFacts(0, -1, 12)


def test_finalize_from_facts_reads_nothing_and_applies_the_runs_limits() -> None:
    manifest = _manifest([
        ("good", 0.5, 4, (3, 99, 100)),
        ("flat", 0.0, 4, (3, 10, 100)),
        ("long", 1.0, 9, (9, 10, 100)),
        ("vocab", 1.0, 4, (2, 100, 100)),
        ("gone", 1.0, 4, (2, 10, 100)),
    ])  # fmt: skip
    result = finalize_step(manifest, {"gone": PayloadMissingError("rlship:unit:rollout:gone")})
    assert result.failures == {
        "long": "input_ids: length 9 exceeds seq_len 8",
        "vocab": "input_ids: token id 100 outside [0, 100)",
        "gone": "payload: payload key 'rlship:unit:rollout:gone' is missing from Redis (never written, "
        "expired or released)",
    }
    assert result.samples.labels["rollout_id"] == ["good", "flat"]
    assert result.samples.numeric["num_tokens"].tolist() == [4.0, 4.0]
    assert result.samples.numeric["trainable_tokens"].tolist() == [3.0, 0.0], "none at zero advantage"


def test_arrays_read_win_over_facts() -> None:
    """A blob written over after the producer's check (another size) is read and checked whole."""
    manifest = _manifest([("changed", 1.0, 4, (3, 9, 100)), ("plain", 1.0, 4, None)])
    short = {"input_ids": np.arange(3), "loss_mask": np.ones(3, bool), "inference_logprobs": np.zeros(3)}
    result = finalize_step(manifest, {"changed": short})
    assert result.failures == {
        "changed": "input_ids: length 3, the record says 4 tokens",
        "plain": "payload: not found",
    }


def test_which_rollouts_are_read() -> None:
    cohort = _manifest([
        ("same", 1.0, 4, (3, 9, 100)), ("resized", 1.0, 4, (3, 9, 100)), ("gone", 1.0, 4, (3, 9, 100)),
        ("without", 1.0, 4, None),
    ]).effective  # fmt: skip
    assert rollouts_with_facts(cohort) == ["same", "resized", "gone"]
    assert rollouts_to_read(cohort, {"same": 100, "resized": 96, "gone": 0}) == ["resized", "gone", "without"]


def test_a_cohort_from_before_the_facts_reads_every_rollout() -> None:
    cohort = _manifest([("a", 1.0, 4, None), ("b", 1.0, 4, None)]).effective
    assert FACT_COLUMNS[0] not in cohort.numeric
    assert rollouts_with_facts(cohort) == [] and rollouts_to_read(cohort, {}) == ["a", "b"]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(0, 12),
    ids=st.lists(st.integers(0, 150), min_size=12, max_size=12),
    mask=st.lists(st.booleans(), min_size=12, max_size=12),
    advantage=st.sampled_from([0.0, -0.5, 1.0]),
)
def test_facts_and_arrays_agree_on_what_a_producer_accepts(tokens, ids, mask, advantage) -> None:
    """The oracle is the arrays themselves: the verdict and annotations of finalize over the
    arrays, against those over the facts of the same arrays (a producer with a vocabulary of
    1000 and seq_len 64 accepted them; the run allows 100 and 8)."""
    arrays = {
        "input_ids": np.array(ids[:tokens], dtype=np.int64),
        "loss_mask": np.array(mask[:tokens], dtype=bool),
        "inference_logprobs": np.zeros(tokens, dtype=np.float32),
    }
    assert check_rollout_arrays(arrays, tokens, 64, 1000) is None
    facts = PayloadFacts.of(arrays, len(pack_arrays(arrays)))
    by_facts = finalize_step(_manifest([("r", advantage, tokens, tuple(facts.columns().values()))]), {})
    by_arrays = finalize_step(_manifest([("r", advantage, tokens, None)]), {"r": arrays})
    assert by_facts.failures == by_arrays.failures
    for column in ("num_tokens", "trainable_tokens"):
        assert by_facts.samples.numeric[column].tolist() == by_arrays.samples.numeric[column].tolist()
    expected_loss = sum(mask[:tokens]) if advantage else 0
    if not by_facts.failures:
        assert by_facts.samples.numeric["trainable_tokens"].tolist() == [expected_loss]


@pytest.mark.parametrize("largest", [98, 99, 100])
def test_the_vocabulary_bound(largest: int) -> None:
    result = finalize_step(_manifest([("r", 1.0, 4, (1, largest, 50))]), {})
    assert bool(result.failures) == (largest >= VOCAB)


WIRE = "prime-rl-0f59b24"  # a wire that carries side arrays by handle


def test_facts_of_side_arrays_by_handle_name_their_one_file(tmp_path) -> None:
    """A rollout whose segments are in one file: the facts name it, the bytes its rows need
    and a field; finalize checks that file as it is at the cut and reads no blob."""
    from transport.payload_segments import PAYLOAD_FIELD, write_segment_file

    path = tmp_path / "with space" / "r.rows"
    path.parent.mkdir()
    rows = np.zeros((5, 3, 2), np.uint8)
    segments = write_segment_file(path, {"routed_experts": rows, "sampling_mask": np.zeros((5, 4), np.int32)})
    arrays = {"input_ids": np.arange(5), "loss_mask": np.ones(5, bool), PAYLOAD_FIELD: segments}
    facts = PayloadFacts.of(arrays, 90)
    assert facts == PayloadFacts(5, 4, 90, 2, 30 + 80, "routed_experts", str(path))
    assert PayloadFacts.from_wire(facts.to_wire().encode()) == facts
    assert facts.to_wire() == f"5 4 90 2 110 routed_experts {path}"
    for bad in (f"5 4 90 2 0 routed_experts {path}", "5 4 90 2 110 routed_experts", "5 4 90 0"):
        assert PayloadFacts.from_wire(bad) is None, bad

    builder = CohortBuilder()
    for rollout_id in ("kept", "gone"):
        numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {"advantage": 1.0, "num_output_tokens": 5}
        labels = {"rollout_id": rollout_id} | facts.labels()
        if rollout_id == "gone":
            labels["rows_file"] = str(tmp_path / "gone.rows")
        builder.append(numeric | facts.columns(), labels)
    cohort = builder.build()
    manifest = StepManifest(
        "unit", 3, 2, 0.0, ShipConfig(ranks=1, seq_len=SEQ_LEN, vocab_size=VOCAB, wire=WIRE), cohort, cohort
    )
    result = finalize_step(manifest, {}, {})  # nothing read
    assert result.samples.labels["rollout_id"] == ["kept"]
    gone = tmp_path / "gone.rows"
    assert result.failures == {
        "gone": f"payload.routed_experts: file {gone} cannot be read (No such file or directory)"
    }
    path.write_bytes(b"\0" * 100)  # shorter than the 110 bytes its rows need
    assert finalize_step(manifest, {}, {}).failures["kept"] == (
        f"payload.routed_experts: file {path} holds 100 bytes, its rows need 110"
    )
