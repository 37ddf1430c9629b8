"""The record's names, end to end (real Redis and Celery workers), against a list written
here from prime-rl's orchestrator at commit 559b447: `orchestrator/metrics.py`
(`Stat.to_dict`: mean/max/min/p10/p90; `EpisodeMetrics.to_wandb`: episode sums under
`train/{scope}/{subset}/`, `has_error`/`cancelled` for `all`, then per agent;
`TraceMetrics.to_dict`; `TrainMetrics`' `is_trainable`/`is_admitted`) and the step's
`metrics |= {...}` of `orchestrator.py` (`progress/*`, `time/*`, `off_policy/*`,
`batch/{env}`), and its pipeline logger's `event_loop_lag/*`. Under `record_names` =
`rlship-1` the record keeps the earlier names and none of these."""

from __future__ import annotations

import re

import pytest

from orchestrator.producer import RolloutProducer
from tests.support.factories import rollout
from tests.support.shiprun import metrics_lines, ship, ship_settings

STATS = r"(mean|max|min|p10|p90)"
EPISODE = r"(num_total_tokens|num_input_tokens|num_output_tokens|num_turns|num_branches)"
SCOPE = r"train/(agg|math|code)/(all|effective)"
AGENT = r"(agent|solver|critic)"
# Every name prime-rl 559b447 logs per step that an rlship run of plain rollouts can fill.
PRIME_559B447 = [
    rf"{SCOPE}/{EPISODE}/{STATS}",
    r"train/(agg|math|code)/all/(has_error|cancelled)/mean",
    rf"{SCOPE}/{AGENT}/(reward|{EPISODE[1:-1]})/{STATS}",
    rf"{SCOPE}/{AGENT}/(is_truncated|is_completed|is_trainable|is_admitted)/mean",
    rf"{SCOPE}/{AGENT}/metrics/[a-z_]+/{STATS}",
    rf"train/(agg|math|code)/all/{AGENT}/(has_error|cancelled)/mean",
    rf"train/(agg|math|code)/all/{AGENT}/error/[a-z_]+",
    rf"train/(agg|math|code)/all/{AGENT}/solved_(none|all|some)",
    rf"{SCOPE}/{AGENT}/stop_condition/(generation_truncated|[a-z_]+)",
    r"progress/(tokens|input_tokens|output_tokens|rollouts|tasks|total_tokens|total_rollouts|total_tasks)",
    r"time/(pack|wait_for_policy)",
    r"off_policy/(mean|max|dropped)",
    r"batch/(math|code)",
    r"event_loop_lag/(min|mean|median|p90|p99|max|n)",
    r"step",
]
# rlship's own keys, which name nothing of prime-rl's (docs/metrics.md).
RLSHIP_OWN = [
    r"accounting/.+",
    r"credit/(given|group_baseline)",
    r"ingest/rejected/.+",
    r"empty_step/.+",
    r"time/(finalize|prune|metrics|encode|send|ship)",
    r"event_loop_lag/(p50_ms|p99_ms|max_ms|samples)",
    r"progress/dropped_by_workers(/.+)?",
    r"progress/total_(input_tokens|output_tokens|dropped_by_workers|steps)",
]
# Names of the earlier record (rlship-1), some of which 559b447 gives another meaning.
RLSHIP_1_ONLY = [
    "train/agg/all/count", "train/agg/all/reward/p50", "train/agg/effective/advantage/mean",
    "train/agg/all/reward/mean", "train/agg/all/num_groups", "off_policy/staleness/max",
    "off_policy/stale_dropped", "progress/samples", "progress/prefill_tokens", "reward/mean", "seq_len/mean",
    "batch/solve_all", "error/mean", "time/wait_for_ckpt", "scheduler/cancelled_rollouts",
]  # fmt: skip

# group id -> env, agent and per rollout: reward, input tokens, output tokens, truncated, stop, error
GROUPS = {
    "g0": ("math", None, [(1.0, 5, 20, False, "stop", None), (0.0, 5, 31, True, "length", None),
                          (1.0, 5, 12, False, "stop", None), (0.0, 5, 40, True, "prompt_too_long", None)]),
    "g1": ("code", "solver", [(1.0, 9, 7, False, None, None), (1.0, 9, 8, False, "stop", None),
                              (0.0, 9, 50, True, "length", None), (0.0, 9, 3, False, "stop", None)]),
    "g2": ("code", "critic", [(0.0, 3, 10, False, "stop", "timeout"), (0.0, 3, 11, False, "stop", None),
                              (0.0, 3, 12, False, "stop", "timeout"), (0.0, 3, 13, False, "stop", None)]),
}  # fmt: skip


def write_rollouts(client, run_id: str) -> None:
    producer = RolloutProducer(client, run_id)
    for group_id, (env, agent, members) in GROUPS.items():
        batch = []
        for i, (reward, prompt, output, truncated, stop, error) in enumerate(members):
            fields = {"is_truncated": truncated, "stop_condition": stop, "error": error, "agent": agent}
            if env == "math":
                fields["metrics"] = {"solve_time": float(i)}
            batch.append(rollout(f"{group_id}-r{i}", group_id, reward, env=env, num_input_tokens=prompt,
                                 num_output_tokens=output, **fields))  # fmt: skip
        producer.produce(batch)


def prime_percentile(values: list[float], q: float) -> float:
    """prime-rl 559b447's `Stat.percentile`, written out again."""
    values = sorted(values)
    rank = q / 100 * (len(values) - 1)
    low = int(rank)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


def run_record(client, redis_url, run_id, workers, tmp_path, names: str) -> dict[str, float]:
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=1, batch_size=8, group_size=4, transport="fs",
        trainers="external", envs=["math", "code"], record_names=names,
    )  # fmt: skip
    write_rollouts(client, run_id)
    ship(settings, trainers=False, produce=False)
    [record] = metrics_lines(settings)
    return record


@pytest.mark.timeout(120)
def test_the_record_has_prime_rl_559b447_names(client, redis_url, run_id, workers, tmp_path):
    record = run_record(client, redis_url, run_id, workers, tmp_path, "prime-rl-559b447")
    allowed = re.compile("|".join(f"(?:{p})" for p in PRIME_559B447 + RLSHIP_OWN))
    assert [key for key in record if not allowed.fullmatch(key)] == []
    assert [name for name in RLSHIP_1_ONLY if name in record] == []
    # The window holds 12 rollouts of 3 groups; g2 (all 0: zero advantage) does not ship.
    rows = [(g, env, agent or "agent", *m) for g, (env, agent, members) in GROUPS.items() for m in members]
    totals = [float(r[4] + r[5]) for r in rows]
    expected = {
        "train/agg/all/num_total_tokens/mean": sum(totals) / len(totals),
        "train/agg/all/num_total_tokens/p10": prime_percentile(totals, 10),
        "train/agg/all/num_total_tokens/p90": prime_percentile(totals, 90),
        "train/agg/all/num_branches/max": 1.0,
        "train/agg/all/has_error/mean": 2 / 12,
        "train/code/all/critic/error/timeout": 2.0,
        "train/code/all/critic/solved_none": 1.0,
        "train/code/all/solver/solved_some": 1.0,
        "train/agg/all/agent/stop_condition/generation_truncated": 1 / 4,  # prompt_too_long is not one
        "train/agg/all/agent/stop_condition/prompt_too_long": 1 / 4,
        "train/code/all/solver/stop_condition/stop": 2 / 3,  # among the rollouts with a condition
        "train/code/effective/solver/reward/mean": 0.5,
        "train/math/all/agent/metrics/solve_time/p90": prime_percentile([0.0, 1.0, 2.0, 3.0], 90),
        "train/agg/all/critic/is_trainable/mean": 0.0,
        "train/agg/effective/agent/is_admitted/mean": 1.0,
        "progress/tokens": sum(totals),
        "progress/rollouts": 12.0,
        "progress/tasks": 3.0,
        "progress/input_tokens": float(sum(r[4] for r in rows if r[0] != "g2")),
        "progress/output_tokens": float(sum(r[5] for r in rows if r[0] != "g2")),
        "progress/total_tokens": 0.0,  # prime-rl logs its totals before adding the step
        "batch/math": 4 / 12,
        "batch/code": 8 / 12,
        "off_policy/max": 0.0,
        "off_policy/dropped": 0.0,
    }
    for name, value in expected.items():
        assert record[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
    assert "train/code/effective/critic/reward/mean" not in record, "no critic rollout shipped"
    assert "train/agg/effective/agent/has_error/mean" not in record, "errors are for `all` only"
    assert record["time/wait_for_policy"] >= 0.0 and record["time/pack"] >= 0.0


@pytest.mark.timeout(120)
def test_rlship_1_keeps_the_earlier_names(client, redis_url, run_id, workers, tmp_path):
    record = run_record(client, redis_url, run_id, workers, tmp_path, "rlship-1")
    assert [name for name in RLSHIP_1_ONLY if name not in record] == []
    only_559b447 = re.compile(
        rf"{SCOPE}/(num_branches|{AGENT})/.*|off_policy/(mean|max|dropped)|event_loop_lag/(median|p99|n)"
    )
    assert [key for key in record if only_559b447.fullmatch(key)] == []
    assert record["progress/tokens"] == record["progress/input_tokens"] + record["progress/output_tokens"]
