"""The pure stage functions, without a broker."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.groups import TRAINABLE, decide_group, group_advantages
from tasks.cohort import Cohort, CohortBuilder
from tasks.manifest import ShipConfig, StepManifest
from tasks.stages.finalize import check_rollout_arrays, finalize_step
from tasks.stages.metrics import distribution, step_metrics, train_metrics
from tasks.stages.pack import first_fit_decreasing, pack_samples, split_to_multiple
from tasks.stages.prune import prune_samples
from tests.support import reference
from tests.support.factories import group, rollout


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 256), min_size=0, max_size=80),
    ranks=st.integers(1, 8),
    pad=st.sampled_from([1, 8]),
)
def test_pack_places_every_sample_once_with_equal_counts(lengths, ranks, pad):
    plan = pack_samples(np.array(lengths, dtype=np.int64), ranks, seq_len=256, pad_to_multiple=pad)
    assert len(plan.ranks) == ranks
    counts = {len(rank) for rank in plan.ranks}
    assert len(counts) == 1 and counts.pop() >= 1, "every rank gets the same, non-zero number"
    placed = sorted(i for rank in plan.ranks for mb in rank for i in mb.samples)
    assert placed == list(range(len(lengths)))
    for rank in plan.ranks:
        for mb in rank:
            assert mb.tokens == sum(lengths[i] for i in mb.samples)
            assert mb.total_tokens <= 256 and mb.total_tokens % pad == 0
    totals = plan.rank_tokens()
    biggest = max((mb.total_tokens for rank in plan.ranks for mb in rank), default=0)
    assert max(totals) - min(totals) <= biggest, "balanced within one micro-batch"


def test_pack_balances_better_than_round_robin():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6, 1.2, 600).astype(np.int64), 1, 2048)
    bins = split_to_multiple(first_fit_decreasing(lengths, 2048), lengths, 8)
    round_robin = [sum(mb.tokens for mb in bins[r::8]) for r in range(8)]
    totals = pack_samples(lengths, ranks=8, seq_len=2048).rank_tokens()
    assert max(totals) - min(totals) < (max(round_robin) - min(round_robin)) / 2


def test_pack_rejects_a_sample_longer_than_seq_len():
    with pytest.raises(ValueError, match="sample length 300 exceeds seq_len 256"):
        pack_samples(np.array([300]), ranks=1, seq_len=256)


def test_group_advantages_are_exactly_zero_for_equal_rewards():
    assert np.all(group_advantages(np.array([0.1, 0.1, 0.1])) == 0.0)
    np.testing.assert_allclose(group_advantages(np.array([1.0, 0.0, 0.5])), [0.5, -0.5, 0.0])


def test_decide_group_fates():
    records = [r for r, _ in group("g", [1.0, 0.0, 0.5])]
    errored, _ = rollout("g-err", "g", 0.0, error="timeout")
    fates = {o.record.rollout_id: o.fate for o in decide_group([*records, errored], 0, 8)}
    assert fates == {"g-r0": TRAINABLE, "g-r1": TRAINABLE, "g-r2": "zero_advantage", "g-err": "error"}
    stale = decide_group([r for r, _ in group("h", [1.0, 0.0], policy_version=0)], 10, 8)
    assert {o.fate for o in stale} == {"stale"}


def _cohort(rows: list[dict]) -> Cohort:
    builder = CohortBuilder()
    for row in rows:
        numeric = {
            "reward": row.get("reward", 0.0), "advantage": row.get("advantage", 0.0),
            "num_input_tokens": 4, "num_output_tokens": row.get("out", 6), "num_turns": 1,
            "temperature": 1.0, "policy_version": 0, "is_truncated": 0, "is_trainable": 1,
            "has_error": 0, "cancelled": 0,
        }  # fmt: skip
        labels = {"rollout_id": row["id"], "env": row.get("env", "math"), "group_id": row.get("group", "g")}
        builder.append(numeric, labels, row.get("custom"))
    return builder.build()


def test_cohort_builder_backfills_custom_metrics_and_round_trips():
    cohort = _cohort([{"id": "a"}, {"id": "b", "custom": {"x": 2.0}}, {"id": "c"}])
    assert np.isnan(cohort.numeric["metric/x"][[0, 2]]).all() and cohort.numeric["metric/x"][1] == 2.0
    again = Cohort.from_bytes(cohort.to_bytes())
    assert again.labels == cohort.labels
    for name, values in cohort.numeric.items():
        np.testing.assert_array_equal(again.numeric[name], values)


def _manifest(effective: Cohort, window: Cohort | None = None) -> StepManifest:
    return StepManifest(
        run_id="unit",
        step=3,
        prev_step=2,
        cut_time=0.0,
        config=ShipConfig(ranks=2, seq_len=64, vocab_size=1000),
        effective=effective,
        window=window if window is not None else effective,
    )


def test_finalize_drops_bad_payloads_with_named_reasons_and_keeps_the_rest():
    good = rollout("good", "g", 1.0)
    long_ids = rollout("bad-len", "g", 1.0)
    long_ids[1]["input_ids"] = np.arange(11)
    nan = rollout("nan", "g", 1.0)
    nan[1]["inference_logprobs"] = np.array([np.nan] * 10, dtype=np.float32)
    big = rollout("big", "g", 1.0)
    big[1]["input_ids"] = np.full(10, 5000)
    rows = [{"id": r.rollout_id, "advantage": 0.5} for r, _ in (good, long_ids, nan, big)] + [{"id": "gone"}]
    manifest = _manifest(_cohort(rows))
    payloads = {r.rollout_id: a for r, a in (good, long_ids, nan, big)}
    result = finalize_step(manifest, payloads)
    assert result.samples.labels["rollout_id"] == ["good"]
    assert result.samples.numeric["staleness"][0] == 3.0
    assert result.samples.numeric["trainable_tokens"][0] == 6
    assert result.failures["bad-len"] == "input_ids: length 11, the record says 10 tokens"
    assert result.failures["nan"] == "inference_logprobs: non-finite value nan"
    assert result.failures["big"] == "input_ids: token id 5000 outside [0, 1000)"
    assert result.failures["gone"].startswith("payload:")


def test_check_rollout_arrays_names_missing_array():
    assert (
        check_rollout_arrays({"input_ids": np.arange(3)}, 3, 64, 100) == "loss_mask: missing from the payload"
    )


def test_prune_drops_samples_without_trainable_tokens():
    cohort = _cohort([{"id": "a"}, {"id": "b"}]).with_numeric(trainable_tokens=np.array([3.0, 0.0]))
    kept, dropped = prune_samples(cohort)
    assert kept.labels["rollout_id"] == ["a"] and dropped == ["b"]


# Eight finite values (and a NaN, left out): every percentile falls between two ranks, so
# the interpolation method decides it. Linear interpolation between closest ranks, by hand
# over the sorted values 1 2 4 8 16 32 64 128 (rank = q/100 * (8 - 1)):
#   p10: rank 0.7 -> 1 + 0.7 * (2 - 1) = 1.7
#   p50: rank 3.5 -> 8 + 0.5 * (16 - 8) = 12
#   p90: rank 6.3 -> 64 + 0.3 * (128 - 64) = 83.2
UNORDERED = [64.0, 1.0, 32.0, float("nan"), 2.0, 16.0, 4.0, 8.0, 128.0]
BY_HAND = {"mean": 255 / 8, "min": 1.0, "max": 128.0, "p10": 1.7, "p50": 12.0, "p90": 83.2}


def test_distribution_interpolates_linearly_between_ranks():
    assert distribution(np.array(UNORDERED)) == pytest.approx(BY_HAND, rel=1e-12)
    assert distribution(np.array([np.nan])) == {}


def test_the_reference_percentiles_agree_by_hand():
    finite = [v for v in UNORDERED if v == v]
    assert reference.stats(finite) == pytest.approx(BY_HAND, rel=1e-12)


def test_an_empty_window_publishes_the_same_keys_as_a_full_one():
    full = _cohort([{"id": "a", "reward": 1.0}, {"id": "b"}])
    empty = full.take([])
    with_rollouts, without = train_metrics(full, full), train_metrics(empty, full)
    assert without.keys() == with_rollouts.keys()
    assert without["train/agg/all/count"] == 0
    stats = [k for k in without if k.startswith("train/agg/all/") and k != "train/agg/all/count"]
    assert stats and all(math.isnan(without[k]) for k in stats if k != "train/agg/all/num_groups")
    assert without["train/agg/all/num_groups"] == 0
    # The reference publishes the same for an empty subset.
    assert {f"train/agg/all/{k}" for k in reference.subset([], "all")} == {
        k for k in without if k.startswith("train/agg/all/")
    }


def test_train_metrics_cover_all_and_effective_per_env():
    window = _cohort([
        {"id": "a", "reward": 1.0, "env": "math", "group": "g1"},
        {"id": "b", "reward": 1.0, "env": "math", "group": "g1"},
        {"id": "c", "reward": 0.0, "env": "code", "group": "g2", "custom": {"t": 4.0}},
    ])  # fmt: skip
    shipped = window.take([0])
    record = train_metrics(window, shipped)
    assert record["train/agg/all/count"] == 3 and record["train/agg/effective/count"] == 1
    assert record["train/math/all/reward/mean"] == 1.0 and record["train/code/all/reward/mean"] == 0.0
    assert record["train/agg/all/solved_all"] == 0.5 and record["train/agg/all/solved_none"] == 0.5
    assert record["train/agg/all/metric/t/mean"] == 4.0, "NaN (not reported) rows are left out"
    assert record["train/code/effective/count"] == 0
    assert "train/agg/effective/has_error/mean" not in record, "error rates are for `all` only"


def test_step_metrics_progress_and_lag():
    cohort = _cohort([{"id": "a", "reward": 1.0}, {"id": "b"}])
    manifest = _manifest(cohort)
    manifest.loop_lag_ms = np.array([1.0, 2.0, 30.0])
    shipped = cohort.with_numeric(staleness=np.array([1.0, 3.0]))
    record = step_metrics(manifest, shipped, dropped_by_workers=["invalid_payload: input_ids: length 3"])
    assert record["progress/tokens"] == 20 and record["progress/rollouts"] == 2
    assert record["off_policy/staleness/max"] == 3.0 and record["batch/math"] == 1.0
    assert record["event_loop_lag/max_ms"] == 30.0
    assert record["progress/dropped_by_workers"] == 1 and record["progress/dropped_by_workers/input_ids"] == 1


def test_cohort_builder_is_a_queue_of_rows():
    builder = CohortBuilder()
    for i, custom in enumerate([None, {"x": 1.0}, None, {"x": 3.0}]):
        numeric = {name: float(i) for name in ("reward", "advantage", "num_input_tokens", "num_output_tokens",
                                               "num_turns", "temperature", "policy_version", "is_truncated",
                                               "is_trainable", "has_error", "cancelled")}  # fmt: skip
        builder.append(numeric, {"rollout_id": f"r{i}"}, custom)
    first = builder.take(2)
    assert first.labels["rollout_id"] == ["r0", "r1"] and len(builder) == 2
    np.testing.assert_array_equal(first.numeric["metric/x"], [np.nan, 1.0])
    removed = builder.remove(builder.column("reward") == 3.0)
    assert removed.labels["rollout_id"] == ["r3"] and builder.rollout_ids == ["r2"]
    builder.append({**{n: 9.0 for n in first.numeric if not n.startswith("metric/")}}, {"rollout_id": "r9"})
    assert builder.build().labels["rollout_id"] == ["r2", "r9"]
    assert np.isnan(builder.build().numeric["metric/x"]).all()
