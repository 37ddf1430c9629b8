"""prime-rl 0002457f's metric names in the published record of `record_names` `rlship-1`,
end to end (real Redis and Celery workers), against values computed here from the rollouts
this test wrote, following prime-rl's orchestrator (`to_log` in orchestrator.py): its batch is every rollout
generated for the step (here every rollout finalized before the cut), its per-example
statistics are per-example means summarized over examples, `reward/std` is pandas' (ddof
1), error shares are among the errored rollouts, per-env reward only with several envs."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from orchestrator.producer import RolloutProducer
from tasks.cohort import CohortBuilder
from tasks.stages.prime_names import from_step
from tests.support.factories import rollout
from tests.support.shiprun import metrics_lines, ship, ship_settings

# group id -> env and, per rollout: reward, input tokens, output tokens, turns, truncated, error, metric
GROUPS = {
    "g0": ("math", [(1.0, 5, 20, 1, False, None, 0.5), (0.0, 5, 31, 2, True, None, 1.5),
                    (1.0, 5, 12, 1, False, None, None), (0.0, 5, 40, 3, True, None, 2.0)]),
    "g1": ("code", [(1.0, 9, 7, 1, False, None, None), (1.0, 9, 8, 1, False, None, None),
                    (0.0, 9, 50, 4, True, None, None), (0.0, 9, 3, 1, False, None, None)]),
    "g2": ("math", [(1.0, 3, 10, 1, False, None, 4.0)] * 4),  # every rollout solved: zero advantage
    "g3": ("code", [(0.0, 7, 6, 2, False, "timeout", None), (0.0, 7, 9, 1, False, "sandbox", None),
                    (0.0, 7, 2, 1, False, "timeout", None), (0.0, 7, 30, 2, True, None, None)]),
}  # fmt: skip
SHIPPED = ("g0", "g1")  # the trainable groups: one batch of 8


def write_rollouts(client, run_id: str) -> None:
    producer = RolloutProducer(client, run_id)
    for group_id, (env, members) in GROUPS.items():
        batch = []
        for i, (reward, prompt, output, turns, truncated, error, metric) in enumerate(members):
            fields = {"num_turns": turns, "is_truncated": truncated, "error": error}
            if metric is not None:
                fields["metrics"] = {"solve_time": metric}
            batch.append(rollout(f"{group_id}-r{i}", group_id, reward, env=env, num_input_tokens=prompt,
                                 num_output_tokens=output, **fields))  # fmt: skip
        producer.produce(batch)


def expected_names() -> dict[str, float]:
    """prime-rl's quantities for the first step, from GROUPS alone."""
    rows = [(group_id, env, *m) for group_id, (env, members) in GROUPS.items() for m in members]
    rewards = [r[2] for r in rows]
    expected: dict[str, float] = {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/std": statistics.stdev(rewards),
        "reward/min": min(rewards),
        "reward/max": max(rewards),
        "reward/median": statistics.median(rewards),
    }
    # Each group here is one example (task): per-example means, then mean/max/min over them.
    columns = {"seq_len": lambda r: r[3] + r[4], "prefill_len": lambda r: r[3], "decode_len": lambda r: r[4],
               "num_turns": lambda r: r[5], "is_truncated": lambda r: float(r[6])}  # fmt: skip
    for name, column in columns.items():
        means = [statistics.mean(column(r) for r in rows if r[0] == g) for g in GROUPS]
        expected |= {f"{name}/mean": statistics.mean(means), f"{name}/max": max(means)}
        expected[f"{name}/min"] = min(means)
    sums = {g: [m[0] for m in members] for g, (_, members) in GROUPS.items()}
    expected["batch/solve_all"] = sum(sum(r) == len(r) for r in sums.values()) / len(sums)  # g2: 1/4
    expected["batch/solve_none"] = sum(sum(r) == 0 for r in sums.values()) / len(sums)  # g3: 1/4
    expected["batch/effective_batch_size"] = 0.5
    errors = [r[7] for r in rows if r[7]]
    expected["error/mean"] = len(errors) / len(rows)
    expected["error/timeout"], expected["error/sandbox"] = 2 / 3, 1 / 3
    expected["errored_rollouts/all"] = expected["error/mean"]
    expected["errored_rollouts/math"], expected["errored_rollouts/code"] = 0.0, 3 / 8
    expected["metrics/solve_time"] = statistics.mean([r[8] for r in rows if r[8] is not None])
    for env in ("math", "code"):
        expected[f"reward/{env}"] = statistics.mean(r[2] for r in rows if r[1] == env)
    shipped = [r for r in rows if r[0] in SHIPPED]
    expected["progress/samples"] = expected["progress/total_samples"] = float(len(shipped))
    expected["progress/problems"] = expected["progress/total_problems"] = float(len(SHIPPED))
    expected["progress/prefill_tokens"] = float(sum(r[3] for r in shipped))
    expected["progress/decode_tokens"] = float(sum(r[4] for r in shipped))
    expected["progress/tokens"] = expected["progress/prefill_tokens"] + expected["progress/decode_tokens"]
    expected["scheduler/cancelled_rollouts"] = 0.0
    return expected


@pytest.mark.timeout(120)
def test_the_record_carries_prime_rl_names(client, redis_url, run_id, workers, tmp_path):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=1, batch_size=8, group_size=4, transport="fs",
        trainers="external", envs=["math", "code"], record_names="rlship-1",
    )  # fmt: skip
    write_rollouts(client, run_id)
    ship(settings, trainers=False, produce=False)
    [record] = metrics_lines(settings)
    for name, value in expected_names().items():
        assert record[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
    prime_errors = {k for k in record if k.startswith("error/")}
    assert prime_errors == {"error/mean", "error/timeout", "error/sandbox"}
    assert record["time/wait_for_ckpt"] == record["time/wait_for_policy"]
    # The same lag samples as rlship's own keys, in seconds.
    assert record["event_loop_lag/max"] == pytest.approx(record["event_loop_lag/max_ms"] / 1000)
    lag = [record[f"event_loop_lag/{s}"] for s in ("min", "med", "p90", "max")]
    assert lag == sorted(lag) and lag[0] >= 0.0
    assert record["event_loop_lag/min"] <= record["event_loop_lag/mean"] <= record["event_loop_lag/max"]


def test_a_step_without_new_rollouts_has_the_same_keys_as_nan() -> None:
    got = from_step(CohortBuilder().build(), np.array([4.0, 2.0]))
    assert got["event_loop_lag/max"] == 0.004 and got["event_loop_lag/med"] == 0.003
    assert math.isnan(got["reward/mean"]) and math.isnan(got["seq_len/max"]) and math.isnan(got["error/mean"])
    assert not any(k.startswith(("reward/", "metrics/")) and not math.isnan(v) for k, v in got.items())
    assert from_step(CohortBuilder().build(), np.zeros(0))["event_loop_lag/max"] == 0.0
