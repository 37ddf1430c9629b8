"""The metrics stage against values computed by hand (no numpy percentile, no code under test).

Percentiles are numpy's default, linear interpolation between closest ranks: for n sorted
values x[0..n-1], pq sits at rank q/100 * (n - 1). With x = [1, 2, 4, 8, 16] (n = 5):
p10 at rank 0.4 = 1 + 0.4 * (2 - 1) = 1.4; p50 at rank 2 = 4; p90 at rank 3.6 = 8 + 0.6 * 8 = 12.8.
Lower, higher, nearest or midpoint interpolation would give other numbers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from tasks.cohort import NUMERIC_COLUMNS, Cohort, CohortBuilder
from tasks.manifest import ShipConfig, StepManifest
from tasks.stages.metrics import distribution, step_metrics, subset_metrics, train_metrics

ROW_DEFAULTS: dict[str, Any] = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {
    "num_input_tokens": 4,
    "num_output_tokens": 6,
}


def cohort(*rows: dict[str, Any]) -> Cohort:
    builder = CohortBuilder()
    for row in rows:
        row = dict(row)
        custom = row.pop("custom", None)
        labels = {
            k: row.pop(k)
            for k in ("rollout_id", "env", "group_id", "task_id", "error", "stop_condition")
            if k in row
        }
        builder.append(ROW_DEFAULTS | row, labels, custom)
    return builder.build()


def test_distribution_by_hand() -> None:
    expected = {"mean": 6.2, "min": 1.0, "max": 16.0, "p10": 1.4, "p50": 4.0, "p90": 12.8}
    got = distribution(np.array([16.0, 1.0, 8.0, 2.0, 4.0]))
    assert got == pytest.approx(expected, abs=1e-12)
    assert distribution(np.array([np.nan, 16.0, 1.0, np.nan, 8.0, 2.0, 4.0])) == pytest.approx(
        expected, abs=1e-12
    )
    assert distribution(np.array([-3.0])) == dict.fromkeys(("mean", "min", "max", "p10", "p50", "p90"), -3.0)
    assert distribution(np.array([])) == {}


# Window: 6 rollouts, 3 groups (math/g1 solved by all, math/g2 by one, code/g1 by none; a
# group id repeated in another env is another group). Shipped: rows 0 and 3.
WINDOW = cohort(
    {
        "rollout_id": "m1",
        "env": "math",
        "group_id": "g1",
        "task_id": "t1",
        "reward": 1.0,
        "advantage": 0.0,
        "num_output_tokens": 2,
        "num_turns": 1,
        "is_trainable": 1,
        "stop_condition": "eos",
        "custom": {"len": 3.0},
    },
    {
        "rollout_id": "m2",
        "env": "math",
        "group_id": "g1",
        "task_id": "t1",
        "reward": 1.5,
        "advantage": 0.0,
        "num_output_tokens": 4,
        "num_turns": 2,
        "is_truncated": 1,
        "stop_condition": "length",
    },
    {
        "rollout_id": "m3",
        "env": "math",
        "group_id": "g2",
        "task_id": "t2",
        "reward": 1.0,
        "advantage": 0.5,
        "num_output_tokens": 8,
        "num_turns": 3,
        "stop_condition": "eos",
    },
    {
        "rollout_id": "m4",
        "env": "math",
        "group_id": "g2",
        "task_id": "t2",
        "reward": 0.999,
        "advantage": -0.5,
        "num_output_tokens": 16,
        "num_turns": 4,
        "is_trainable": 1,
        "has_error": 1,
        "error": "timeout",
    },
    {
        "rollout_id": "c1",
        "env": "code",
        "group_id": "g1",
        "task_id": "t3",
        "reward": 0.0,
        "advantage": 0.0,
        "num_input_tokens": 10,
        "num_output_tokens": 1,
        "cancelled": 1,
        "error": "timeout",
    },
    {
        "rollout_id": "c2",
        "env": "code",
        "group_id": "g1",
        "task_id": "t3",
        "reward": 0.5,
        "advantage": 0.0,
        "num_input_tokens": 20,
        "num_output_tokens": 3,
        "has_error": 1,
        "error": "oom",
        "custom": {"len": 5.0},
    },
)


def test_subset_all_by_hand() -> None:
    got = subset_metrics(WINDOW, "all")
    assert got["count"] == 6.0
    assert got["reward/mean"] == pytest.approx(4.999 / 6)
    assert got["reward/min"] == 0.0 and got["reward/max"] == 1.5
    # num_output_tokens sorted [1, 2, 3, 4, 8, 16]: p10 at rank 0.5 = 1.5, p50 at 2.5 = 3.5, p90 at 4.5 = 12
    assert [got[f"num_output_tokens/{s}"] for s in ("p10", "p50", "p90")] == pytest.approx([1.5, 3.5, 12.0])
    # num_total_tokens = input + output: [6, 8, 12, 20, 11, 23]
    assert got["num_total_tokens/mean"] == pytest.approx(80 / 6) and got["num_total_tokens/max"] == 23.0
    assert got["num_input_tokens/mean"] == pytest.approx(46 / 6)
    assert got["num_turns/max"] == 4.0 and got["advantage/min"] == -0.5
    assert got["metric/len/mean"] == 4.0 and got["metric/len/p50"] == 4.0, "rows without the metric left out"
    assert got["is_truncated/mean"] == pytest.approx(1 / 6)
    assert got["is_trainable/mean"] == pytest.approx(2 / 6)
    assert got["has_error/mean"] == pytest.approx(2 / 6)
    assert got["cancelled/mean"] == pytest.approx(1 / 6)
    assert got["error/timeout"] == 2.0 and got["error/oom"] == 1.0, "errors are counts"
    assert got["stop_condition/eos"] == pytest.approx(2 / 6) and got[
        "stop_condition/length"
    ] == pytest.approx(1 / 6)
    assert "error/" not in got and "stop_condition/" not in got, "rows without an error or stop condition"
    assert got["num_groups"] == 3.0
    assert got["solved_all"] == pytest.approx(1 / 3), "math/g1: 1.0 and 1.5 both reach 1.0"
    assert got["solved_some"] == pytest.approx(1 / 3), "math/g2: 1.0 yes, 0.999 no"
    assert got["solved_none"] == pytest.approx(1 / 3), "code/g1: a group id of another env"


def test_subset_effective_has_no_error_or_group_statistics() -> None:
    got = subset_metrics(WINDOW.take([0, 3]), "effective")
    assert got["count"] == 2.0 and got["reward/mean"] == pytest.approx(1.999 / 2)
    assert got["is_trainable/mean"] == 1.0 and got["is_truncated/mean"] == 0.0
    names = {key.split("/")[0] for key in got}
    expected = "count reward advantage num_total_tokens num_input_tokens num_output_tokens num_turns metric"
    assert names == {*expected.split(), "is_truncated", "is_trainable"}, "no error or group statistics"
    for subset in ("all", "effective"):
        empty = subset_metrics(WINDOW.take([]), subset)
        assert empty.pop("count") == 0.0
        assert empty.pop("num_groups", 0.0) == 0.0
        assert empty and all(math.isnan(value) for value in empty.values()), "an empty subset: NaN, same keys"
        assert "reward/p90" in empty and "is_trainable/mean" in empty


def test_all_rates_and_group_shares_when_nothing_is_solved_or_truncated() -> None:
    got = subset_metrics(WINDOW.take([4]), "all")
    assert got["num_groups"] == 1.0 and got["solved_none"] == 1.0
    assert got["solved_all"] == 0.0 and got["solved_some"] == 0.0
    assert got["cancelled/mean"] == 1.0 and got["has_error/mean"] == 0.0


def test_train_metrics_scopes() -> None:
    shipped = WINDOW.take([0, 3])
    got = train_metrics(WINDOW, shipped)
    assert got["train/agg/all/count"] == 6.0 and got["train/agg/effective/count"] == 2.0
    assert got["train/math/all/count"] == 4.0 and got["train/code/all/count"] == 2.0
    assert got["train/math/effective/count"] == 2.0 and got["train/code/effective/count"] == 0.0
    assert got["train/code/all/reward/mean"] == 0.25 and got["train/math/effective/reward/max"] == 1.0
    assert got["train/math/all/solved_some"] == 0.5 and got["train/code/all/num_groups"] == 1.0
    scopes = {key.split("/")[1] for key in got}
    assert scopes == {"agg", "math", "code"}
    # an env present only in the shipped cohort still gets its (empty) `all` scope
    only_shipped = train_metrics(WINDOW.take([0]), WINDOW.take([5]))
    assert only_shipped["train/code/all/count"] == 0.0 and only_shipped["train/code/effective/count"] == 1.0


def _manifest(window: Cohort, lag: list[float], counters: dict[str, float]) -> StepManifest:
    return StepManifest(
        run_id="unit",
        step=4,
        prev_step=3,
        cut_time=0.0,
        config=ShipConfig(ranks=1, seq_len=64, record_names="rlship-1"),
        effective=window,
        window=window,
        counters=counters,
        loop_lag_ms=np.array(lag),
    )


def test_step_metrics_by_hand() -> None:
    shipped = WINDOW.take([0, 2, 3]).with_numeric(staleness=np.array([0.0, 1.0, 5.0]))
    manifest = _manifest(WINDOW, [1.0, 2.0, 4.0, 8.0, 16.0], {"accounting/arrived": 9, "progress/x": 2})
    dropped = [
        "invalid_payload: input_ids: length 3, the record says 4 tokens",
        "invalid_payload: loss_mask: missing from the payload",
        "invalid_payload: input_ids: token id 5000 outside [0, 1000)",
        "no_trainable_tokens",
    ]
    got = step_metrics(manifest, shipped, dropped)
    assert got["progress/input_tokens"] == 12.0 and got["progress/output_tokens"] == 26.0
    assert got["progress/tokens"] == 38.0 and got["progress/rollouts"] == 3.0
    assert got["progress/tasks"] == 2.0, "t1 once, t2 twice"
    assert got["progress/dropped_by_workers"] == 4.0
    assert got["progress/dropped_by_workers/input_ids"] == 2.0
    assert got["progress/dropped_by_workers/loss_mask"] == 1.0
    assert got["progress/dropped_by_workers/no_trainable_tokens"] == 1.0
    assert got["off_policy/staleness/mean"] == 2.0 and got["off_policy/staleness/max"] == 5.0
    assert got["batch/math"] == 1.0 and "batch/code" not in got
    # p50 at rank 2 = 4; p99 at rank 3.96 = 8 + 0.96 * 8 = 15.68
    assert got["event_loop_lag/p50_ms"] == 4.0 and got["event_loop_lag/p99_ms"] == pytest.approx(15.68)
    assert got["event_loop_lag/max_ms"] == 16.0 and got["event_loop_lag/samples"] == 5.0
    assert got["accounting/arrived"] == 9.0 and got["progress/x"] == 2.0
    assert all(type(v) is float for v in got.values())
    assert got["train/agg/effective/count"] == 3.0 and got["train/agg/all/count"] == 6.0


def test_step_metrics_mixed_batch_and_no_lag_samples() -> None:
    shipped = WINDOW.take([0, 4, 5, 1]).with_numeric(staleness=np.array([2.0, 2.0, 2.0, 6.0]))
    got = step_metrics(_manifest(WINDOW, [], {}), shipped, [])
    assert got["batch/math"] == 0.5 and got["batch/code"] == 0.5
    assert got["off_policy/staleness/mean"] == 3.0 and got["off_policy/staleness/max"] == 6.0
    assert got["progress/dropped_by_workers"] == 0.0
    assert not any(k.startswith("progress/dropped_by_workers/") for k in got)
    assert [got[f"event_loop_lag/{k}"] for k in ("p50_ms", "p99_ms", "max_ms", "samples")] == [0.0] * 4


def test_step_metrics_of_an_empty_shipment() -> None:
    empty = WINDOW.take([]).with_numeric(staleness=np.zeros(0))
    got = step_metrics(_manifest(WINDOW, [3.0], {}), empty, ["no_trainable_tokens"])
    assert got["progress/rollouts"] == 0.0 and got["progress/tokens"] == 0.0 and got["progress/tasks"] == 0.0
    # prime-rl's batch/solve_* describe the step's `all` rollouts, which this step has
    prime_batch = {"batch/solve_none", "batch/solve_all", "batch/effective_batch_size"}
    assert not any(k.startswith(("off_policy/", "batch/")) for k in got.keys() - prime_batch)
    assert got["event_loop_lag/p99_ms"] == 3.0 and got["event_loop_lag/samples"] == 1.0
