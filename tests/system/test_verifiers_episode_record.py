"""What the record of a run of verifiers episodes says of the traces that train nothing:
errored ones and a judge agent's that does not train. Groups of single-branch episodes go
through an EpisodeProducer, the session's Celery workers and rlship's trainer ranks; each
step's `train/agg/all/{agent}/...` error keys must be what prime-rl 559b447's
`orchestrator/metrics.py` computes over the same traces (the window of a step read from the
rollout log, `--record-rollouts`), and the accounting must count every errored trace as
discarded (`error`), nothing of them shipped.

The oracle, from prime-rl 559b447's `metrics.py`: `all` is every trace of the window
(`TrainEpisodes` without predicate); per agent (`by_agent`, by `trace.agent.name`),
`has_error/mean` is the mean of `trace.has_error`, `error/{type}` the count of
`trace.last_error.type` over the errored traces with an error, `is_trainable/mean` the mean
of `routing.is_trainable` (a non-zero advantage on a node) after the algorithm scored the
group (`grpo_score_group`); `effective` keeps no errored trace and no trace of an agent that
does not train."""

from __future__ import annotations

import copy
import json
from collections import defaultdict

import numpy as np
import pytest

vf = pytest.importorskip("verifiers.v1")

from rlship.verifiers import EpisodeProducer  # noqa: E402
from tests.support import episodes as build  # noqa: E402
from tests.support.prime_559b447_samples import grpo_score_group  # noqa: E402
from tests.support.shiprun import ship, ship_settings  # noqa: E402

pytestmark = pytest.mark.timeout(240)
STEPS = 2


def errored(rng: np.random.Generator, error_type: str, agent: str = "solver") -> vf.Trace:
    """A trace whose run failed with an error of `error_type` (a judge's does not train)."""
    trace = build.TraceBuilder(rng)
    trace.turn(trace.prompt())
    failed = trace.trace(0.0, agent=agent, trainable=agent == "solver", ok=False)
    failed.errors[-1] = vf.Error(type=error_type, message="failed")
    return failed


def groups(run_id: str, rng: np.random.Generator, round_: int) -> list[list[vf.Episode]]:
    """Groups of two episodes of single-branch traces: judged, with errored solvers and an
    errored judge, and plain."""

    def group(name: str, traces: list[list[vf.Trace]]) -> list[vf.Episode]:
        return [build.episode(t, f"{name}-{round_}", run_id=run_id) for t in traces]

    judge = build.judged(rng, 0.0)[1]
    return [
        group("judged", [build.judged(rng, r) for r in (1.0, 0.0)]),
        group("timeout", [[errored(rng, "TimeoutError")], [build.single_turn(rng, 1.0)]]),
        group("mixed", [[errored(rng, "ProviderError"), judge], [build.single_turn(rng, 0.5)]]),
        group("judged-failed", [[build.single_turn(rng, 1.0), errored(rng, "ModelError", "judge")], [judge]]),
        group("plain", [[build.single_turn(rng, r)] for r in (1.0, 0.0)]),
    ]


def is_trainable(trace: vf.Trace) -> bool:
    """prime-rl 559b447's `algo/routing.py` `is_trainable`."""
    return any(value != 0.0 for node in trace.nodes for value in node.advantages or [])


def prime_all_subset(traces: list[vf.Trace]) -> dict[str, float]:
    """The error keys prime-rl 559b447's `TrainMetrics.to_wandb(prefix="train/agg", subset="all")`
    logs over these traces (each of its own episode's record)."""
    out: dict[str, float] = {}
    by_agent: dict[str, list[vf.Trace]] = defaultdict(list)
    for trace in traces:
        by_agent[trace.agent.name].append(trace)
    for agent, mine in sorted(by_agent.items()):
        prefix = f"train/agg/all/{agent}"
        out[f"{prefix}/has_error/mean"] = sum(float(t.has_error) for t in mine) / len(mine)
        types = [t.last_error.type for t in mine if t.has_error and t.last_error is not None]
        out |= {f"{prefix}/error/{kind}": float(types.count(kind)) for kind in sorted(set(types))}
        out[f"{prefix}/is_trainable/mean"] = sum(float(is_trainable(t)) for t in mine) / len(mine)
    return out


def test_errored_and_non_trainable_traces_are_in_the_record_as_prime_rl_counts_them(
    client, redis_url, run_id, workers, tmp_path
):
    log = tmp_path / "rollouts.jsonl"
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=STEPS, batch_size=4, group_size=2,
        max_off_policy_steps=100, record_rollouts=log,
    )  # fmt: skip
    producer = EpisodeProducer.for_run(client, settings, admitted=False)
    rng = np.random.default_rng(7)
    traces: dict[str, vf.Trace] = {}
    written = 0
    for round_ in range(3):
        for episodes in groups(run_id, rng, round_):
            result = producer.produce(episodes)
            written += len(result.rollouts) + len(result.untrained)
            scored = copy.deepcopy(episodes)  # prime-rl's algorithm writes its credit on the nodes
            grpo_score_group(scored)
            traces |= {f"{episode.id}/{trace.id}": trace for episode in scored for trace in episode.traces}
    assert len(traces) == written, "one rollout a single-branch trace, one record a trace that trains nothing"

    shipped = ship(settings, produce=False)
    records = {int(record["step"]): record for record in shipped.records}
    assert sorted(records) == list(range(STEPS))
    windows: dict[int, list[vf.Trace]] = defaultdict(list)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for line in lines:
        trace_key = "/".join(line["rollout_id"].split("/")[:2])
        if line["step"] is not None:
            windows[line["step"]].append(traces[trace_key])
    for step, record in records.items():
        expected = prime_all_subset(windows[step])
        got = {
            key: value
            for key, value in record.items()
            if key.startswith("train/agg/all/")
            and any(part in key for part in ("/has_error/mean", "/error/", "/is_trainable/mean"))
            and key.count("/") > 4  # per agent (the episode-level has_error is per rollout in rlship)
        }
        assert got == expected, step
        assert not any(key.startswith("train/agg/effective/judge/") for key in record), "a judge never ships"
        assert record["accounting/balanced"] == 1.0
    seen = {key.rsplit("/", 1)[-1] for record in records.values() for key in record if "/error/" in key}
    assert {"TimeoutError", "ProviderError", "ModelError"} <= seen, seen
    last = records[STEPS - 1]
    counted = [trace for window in windows.values() for trace in window]
    assert last["accounting/discarded/error"] == sum(trace.has_error for trace in counted)
    assert not any(line.get("shipped_step") is not None and line.get("error") for line in lines)
