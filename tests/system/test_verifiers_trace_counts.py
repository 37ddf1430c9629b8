"""The record counts traces and episodes as prime-rl 559b447 does, whatever rollouts they
became: groups of episodes with forked traces (two and three branches, and one whose second
branch has nothing left to train: two branches, one rollout), several traces an episode (two
solvers; a solver beside a judge that does not train; a solver beside an errored one), in two
envs, go through an EpisodeProducer, the session's Celery workers and rlship's trainer ranks.
Each step's `train/*` keys (per episode, and per trace of each agent, in `all` and
`effective`, agg and per env) and the window's `progress/tokens`, `progress/rollouts`,
`progress/tasks`, `batch/{env}` must be what prime-rl's `metrics.py` computes over the same
episodes (tests.support.prime_559b447_metrics): `all` the traces of the episodes of the step's
window, `effective` the traces with a rollout shipped in the step, none errored or of an agent
that does not train; the windows and shipments read from the rollout log."""

from __future__ import annotations

import copy
import json
from collections import defaultdict

import numpy as np
import pytest

vf = pytest.importorskip("verifiers.v1")

from rlship.verifiers import EpisodeProducer  # noqa: E402
from tests.support import episodes as build  # noqa: E402
from tests.support.prime_559b447_metrics import Selection, step_metrics  # noqa: E402
from tests.support.prime_559b447_samples import grpo_score_group  # noqa: E402
from tests.support.shiprun import ship, ship_settings  # noqa: E402

pytestmark = pytest.mark.timeout(240)
STEPS = 2


def fork3(rng: np.random.Generator, reward: float) -> vf.Trace:
    """A sampled turn forked three ways, each branch its own turn: three branches, three rollouts."""
    trace = build.TraceBuilder(rng)
    shared = trace.turn(trace.prompt())
    for count in (6, 3, 5):
        trace.turn(trace.tool(shared), count=count)
    return trace.trace(reward, stop="max_turns")


def dangling(rng: np.random.Generator, reward: float) -> vf.Trace:
    """A fork whose second branch ends on a user message after the shared turn: two branches,
    one rollout (the second has nothing left to train)."""
    trace = build.TraceBuilder(rng)
    shared = trace.turn(trace.prompt())
    trace.turn(trace.tool(shared))
    trace.add(vf.UserMessage(content="stop"), 3, shared)
    return trace.trace(reward)


def groups(run_id: str, rng: np.random.Generator, round_: int) -> list[list[vf.Episode]]:
    """Groups of two episodes, most of them of several traces, forked ones among them."""

    def group(name: str, traces: list[list[vf.Trace]], env: str = "math") -> list[vf.Episode]:
        return [build.episode(t, f"{name}-{round_}", env=env, run_id=run_id) for t in traces]

    return [
        group("forked", [[build.forked(rng, 1.0)], [build.forked(rng, 0.0)]]),
        group("two-solvers", [[build.forked(rng, 1.0), build.single_turn(rng, 0.0)], [fork3(rng, 0.5)]]),
        group("judged", [[dangling(rng, 1.0), *build.judged(rng, 0.0)[1:]], [fork3(rng, 0.0)]], env="code"),
        group("errored", [[build.forked(rng, 0.5), build.errored(rng)], [dangling(rng, 0.0)]], env="code"),
    ]


def test_forked_traces_and_episodes_of_several_traces_count_as_prime_rl_counts_them(
    client, redis_url, run_id, workers, tmp_path
):
    log = tmp_path / "rollouts.jsonl"
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=STEPS, batch_size=12, group_size=2,
        max_off_policy_steps=100, record_rollouts=log,
    )  # fmt: skip
    producer = EpisodeProducer.for_run(client, settings, admitted=False)
    rng = np.random.default_rng(11)
    traces: dict[str, tuple[vf.Episode, vf.Trace]] = {}
    for round_ in range(3):
        for episodes in groups(run_id, rng, round_):
            producer.produce(episodes)
            scored = copy.deepcopy(episodes)  # prime-rl's algorithm writes its credit on the nodes
            grpo_score_group(scored)
            traces |= {f"{e.id}/{t.id}": (e, t) for e in scored for t in e.traces}
    forks = [t for _, t in traces.values() if t.num_branches > 1]
    assert {t.num_branches for t in forks} == {2, 3}, "two- and three-way forks"

    shipped = ship(settings, produce=False)
    records = {int(record["step"]): record for record in shipped.records}
    assert sorted(records) == list(range(STEPS))
    window: dict[int, set[str]] = defaultdict(set)  # the traces of each step's window
    sampled: dict[int, set[str]] = defaultdict(set)  # the traces with a rollout shipped in a step
    for line in map(json.loads, log.read_text().splitlines()):
        trace = "/".join(line["rollout_id"].split("/")[:2])
        if line["step"] is not None:
            window[line["step"]].add(trace)
        if line.get("shipped_step") is not None:
            sampled[line["shipped_step"]].add(trace)
    for step, record in records.items():
        all_: Selection = [traces[key] for key in traces if key in window[step]]
        effective = [(e, t) for key, (e, t) in traces.items() if key in sampled[step] and t.agent.trainable]
        assert not any(t.has_error for _, t in effective), "an errored trace never ships"
        expected = step_metrics(all_, effective)
        got = {key: value for key, value in record.items() if key.startswith(("train/", "batch/"))}
        got |= {key: record[key] for key in ("progress/tokens", "progress/rollouts", "progress/tasks")}
        assert sorted(got) == sorted(expected), step
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12), step
    assert any(traces[key][1].num_branches > 1 for keys in window.values() for key in keys), "forks counted"
    assert any(len(sampled[step]) for step in records), "traces shipped"
