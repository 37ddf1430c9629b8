"""rlship.verifiers.episode_rollouts against the samples prime-rl 559b447 makes of the same
verifiers 0.4.0 episodes (tests/support/prime_559b447_samples.py, written from prime-rl's
source), over every kind of episode; and its refusals of bad input."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

vf = pytest.importorskip("verifiers.v1")

from orchestrator.rollout_checks import RolloutRejected  # noqa: E402
from rlship.verifiers import (  # noqa: E402
    Conversion,
    convert_group,
    encode_episode,
    episode_rollouts,
    grpo_advantages,
)
from rlship.verifiers.synthetic import SyntheticEpisodes  # noqa: E402
from tests.support import episodes as build  # noqa: E402
from tests.support.prime_559b447_samples import PrimeSample, errored_count, group_samples  # noqa: E402

RUN = "run"


def ours(group, **conversion):
    """rlship's rollouts of a group, credited as EpisodeProducer credits a group without advantages."""
    given = any(node.advantages is not None for e in group for t in e.traces for node in t.nodes)
    advantages = None if given else grpo_advantages(group)
    return convert_group(group, Conversion(run_id=RUN, **conversion), advantages)


def assert_same(rollouts, samples: list[PrimeSample]) -> None:
    assert len(rollouts) == len(samples), (len(rollouts), len(samples))
    for (record, arrays), sample in zip(rollouts, samples, strict=True):
        assert arrays["input_ids"].tolist() == sample.token_ids
        assert arrays["loss_mask"].tolist() == sample.mask
        assert record.env == sample.env_name
        assert [record.temperature] * len(sample.token_ids) == sample.temperatures
        assert record.num_tokens == len(sample.token_ids)
        floats = {
            "inference_logprobs": sample.logprobs,
            "ref_logprobs": sample.ref_logprobs,
            "advantages": sample.advantages,
            "rl_weights": sample.rl_weights,
            "ce_weights": sample.ce_weights,
            "ref_kl_weights": sample.ref_kl_weights,
        }
        for name, expected in floats.items():
            if expected is None:
                assert name not in arrays, name
            else:
                np.testing.assert_array_equal(
                    arrays[name], np.asarray(expected, dtype=np.float32), err_msg=name
                )
        if sample.mm_token_type_ids is None:
            assert "mm_token_type_ids" not in arrays
        else:
            assert arrays["mm_token_type_ids"].tolist() == sample.mm_token_type_ids
        if sample.routed_experts is None:
            assert "routed_experts" not in arrays
        else:
            assert arrays["routed_experts"].dtype == sample.routed_experts.dtype
            np.testing.assert_array_equal(arrays["routed_experts"], sample.routed_experts)


def group_of(make, rewards, rng, **kwargs):
    return [build.episode([make(rng, reward, **kwargs)], "g0") for reward in rewards]


@pytest.mark.parametrize(
    ("kind", "make", "extra"),
    [
        ("single-turn", build.single_turn, {}),
        ("multi-turn with tool messages", build.multi_turn_tools, {}),
        ("forked", build.forked, {}),
        ("multimodal", build.multimodal, {}),
        ("MoE", build.single_turn, {"routed": True}),
        ("MoE multi-turn forked", build.forked, {"routed": True}),
    ],
)
def test_each_kind_matches_prime_rl(kind, make, extra) -> None:
    rng = np.random.default_rng(7)
    group = group_of(make, [1.0, 0.0, 0.5, 1.0], rng, **extra)
    result = ours(group, temperature=0.7)
    assert_same(result.rollouts, group_samples(group, temperature=0.7))
    assert result.errored_traces == 0


def test_a_fork_trains_its_shared_turn_once() -> None:
    group = group_of(build.forked, [1.0, 0.0], np.random.default_rng(1))
    first, second = ours(group).rollouts[:2]
    shared = group[0].traces[0].nodes[1]  # the sampled turn both branches hold
    span = slice(len(group[0].traces[0].nodes[0].token_ids), None)
    positions = slice(span.start, span.start + len(shared.token_ids))
    assert first[1]["loss_mask"][positions].tolist() == shared.mask
    assert not second[1]["loss_mask"][positions].any()
    assert first[0].group_id == second[0].group_id == "g0"
    assert first[0].rollout_id != second[0].rollout_id


def test_given_advantages_and_loss_streams_match_prime_rl() -> None:
    rng = np.random.default_rng(3)
    traces = [build.multi_turn_tools(rng, 1.0), build.forked(rng, 0.0)]
    for trace in traces:
        sampled = sum(sum(node.mask) for node in trace.nodes)
        build.with_advantages(trace, np.linspace(-1.0, 1.0, sampled).round(3).tolist())
        build.with_loss_weights(trace, ("rl", "ce", "ref_kl"))
        for node in trace.nodes:
            if any(node.mask):
                node.reference_logprobs = (-rng.random(sum(node.mask))).tolist()
    group = [build.episode([trace], "g1") for trace in traces]
    assert_same(ours(group).rollouts, group_samples(group))


@pytest.mark.parametrize("action_loss", ["ce", "ref_kl"])
def test_an_algorithm_routing_actions_to_another_loss_matches_prime_rl(action_loss) -> None:
    rng = np.random.default_rng(4)
    traces = [build.with_loss_weights(build.multi_turn_tools(rng, r), ("ce",)) for r in (1.0, 0.0)]
    group = [build.episode([trace], "g2") for trace in traces]
    assert_same(ours(group, action_loss=action_loss).rollouts, group_samples(group, action_loss=action_loss))


def test_errored_and_non_trainable_traces_train_nothing_and_are_recorded() -> None:
    rng = np.random.default_rng(5)
    judge = build.TraceBuilder(rng)
    judge.turn(judge.prompt())
    errored = build.TraceBuilder(rng)
    errored.turn(errored.prompt())
    group = [
        build.episode([build.single_turn(rng, 1.0), judge.trace(0.0, agent="judge", trainable=False)], "g3"),
        build.episode([build.multi_turn_tools(rng, 0.0)], "g3"),
        build.episode([errored.trace(0.0, ok=False)], "g3"),
    ]
    failed_early = vf.Episode(env=vf.EnvInfo(name="math"), task=group[0].task, group=vf.GroupInfo(id="g3"))
    group.append(failed_early)  # no trace at all, not ok: counted as prime-rl counts it
    silent = build.TraceBuilder(rng).trace(0.0)  # ok, but no message at all: nothing to train
    group.append(build.episode([silent], "g3"))
    result = ours(group, policy_version=0)
    assert_same(result.rollouts, group_samples(group))
    assert result.errored_traces == errored_count(group) == 2
    assert result.not_trainable_traces == 1 and result.untrained_traces == 1
    assert {record.rollout_id.split("/")[1] for record, _ in result.rollouts} == {
        group[0].traces[0].id,
        group[1].traces[0].id,
    }
    # Each trace that trains nothing is one record of no tokens, for the step's `all` statistics
    # (prime-rl 559b447's metrics count every trace of the window; the trace-less episode has none).
    untrained = {record.rollout_id: (record, arrays) for record, arrays in result.untrained}
    expected = {
        f"{group[0].id}/{group[0].traces[1].id}": ("judge", None),
        f"{group[2].id}/{group[2].traces[0].id}": ("solver", "ProviderError"),
        f"{group[4].id}/{group[4].traces[0].id}": ("solver", None),
    }
    assert {rid: (record.agent, record.error) for rid, (record, _) in untrained.items()} == expected
    for record, arrays in untrained.values():
        assert record.num_tokens == 0 and all(len(values) == 0 for values in arrays.values())


def test_the_record_says_what_the_episode_says() -> None:
    rng = np.random.default_rng(6)
    trace = build.multi_turn_tools(rng, 0.25)
    [(record, arrays)] = episode_rollouts(
        build.episode([trace], "g4", env="tools", version=3), temperature=0.9
    )
    assert (record.env, record.group_id, record.task_id) == ("tools", "g4", "task-0")
    assert record.policy_version == 3 and record.reward == 0.25 and record.temperature == 0.9
    assert record.num_turns == 3 and record.is_truncated and record.stop_condition == "max_turns"
    assert record.metrics == {"turns_used": 3.0}
    assert record.agent == trace.agent.name == "solver", "the record's per-agent statistics name it"
    assert record.num_output_tokens == int(arrays["loss_mask"].sum())
    assert "advantages" not in arrays  # one episode alone: no group credit unless given


def test_the_msgpack_an_env_server_sends_converts_the_same() -> None:
    rng = np.random.default_rng(8)
    group = group_of(build.forked, [1.0, 0.0], rng, routed=True)
    group[0].traces[0].mm_token_type_id_map = {build.IMAGE_TOKEN: 1}
    direct = [episode_rollouts(episode) for episode in group]
    wired = [episode_rollouts(encode_episode(episode)) for episode in group]
    for left, right in zip(direct, wired, strict=True):
        for (record_a, arrays_a), (record_b, arrays_b) in zip(left, right, strict=True):
            assert record_a == record_b
            assert arrays_a.keys() == arrays_b.keys()
            for name in arrays_a:
                np.testing.assert_array_equal(arrays_a[name], arrays_b[name])


def rejected(group, **conversion) -> dict[str, str]:
    with pytest.raises(RolloutRejected) as caught:
        convert_group(group, Conversion(run_id=RUN, **conversion))
    return caught.value.problems


def test_bad_input_is_named_by_episode_trace_and_node() -> None:
    rng = np.random.default_rng(9)
    traces = [build.multi_turn_tools(rng, 1.0) for _ in range(6)]
    traces[0].nodes[1].mask = traces[0].nodes[1].mask[:-1]
    traces[1].nodes[1].advantages = [0.5]
    traces[2].nodes[3].loss_weights = {"kl": [1.0] * len(traces[2].nodes[3].token_ids)}
    for node in traces[3].nodes:  # an eval client's trace: messages, no token ids
        node.token_ids, node.mask, node.logprobs = [], [], []
    group = [build.episode([trace], "g5") for trace in traces[:4]]
    group.append(build.episode([traces[4]], "g5", run_id="another-run"))
    group.append(build.episode([traces[5]], "g5"))  # no credit, beside a trace with some (traces[1])
    problems = rejected(group)
    lines = {key: line for key, line in problems.items()}
    assert len(lines) == 6 and all("\n" not in line for line in lines.values())
    where = [f"{e.id}/{e.traces[0].id}" for e in group]
    assert lines[where[0]] == f"trace {where[0]}: node 1: mask of 4 for 5 token ids"
    assert lines[where[1]] == f"trace {where[1]}: node 1: advantages of 1 for 4 sampled tokens"
    assert (
        lines[where[2]] == f"trace {where[2]}: node 3: loss stream 'kl' is not one of ['rl', 'ce', 'ref_kl']"
    )
    assert "no token ids on any node" in lines[where[3]]
    assert "advantages: none on any node, while other traces of the group carry" in lines[where[5]]
    assert (
        lines[group[4].id]
        == f"episode {group[4].id!r}: run.id: 'another-run' is another run's (this is run 'run')"
    )


def test_rlship_imports_without_verifiers() -> None:
    code = "import sys, rlship; print('verifiers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_token_types_only_on_branches_with_an_image() -> None:
    rng = np.random.default_rng(10)
    group = group_of(build.multimodal, [1.0, 0.0], rng) + group_of(build.single_turn, [0.5], rng)
    group[2].traces[0].mm_token_type_id_map = {build.IMAGE_TOKEN: 1}  # a text-only branch, same map
    for episode in group:
        episode.group = vf.GroupInfo(id="g6")
    result = ours(group)
    assert_same(result.rollouts, group_samples(group))
    assert "mm_token_type_ids" not in result.rollouts[2][1]


def test_an_abandoned_compaction_attempt_trains_nothing() -> None:
    rng = np.random.default_rng(11)
    trace = build.forked(rng, 1.0)
    attempt = trace.nodes[-1]  # the second branch's leaf: a compaction attempt never resumed from
    attempt.semantic_parents = [vf.ParentLink(node=1, type="compaction_attempt")]
    group = [build.episode([trace], "g7"), build.episode([build.forked(rng, 0.0)], "g7")]
    result = ours(group)
    assert [branch.trainable for branch in trace.branches] == [True, False]
    assert_same(result.rollouts, group_samples(group))
    assert len(result.rollouts) == 3


def test_the_synthetic_workload_makes_every_kind_and_converts_as_prime_rl() -> None:
    """`--workload episodes`: forks, judges, errors and given credit all appear; each group
    converts to prime-rl's samples."""
    synthetic = SyntheticEpisodes(
        RUN, seed=3, group_size={"math": 4, "code": 2}, envs=("math", "code"), seq_len=256
    )
    seen = {"fork": 0, "judge": 0, "errored": 0, "given": 0}
    for _ in range(40):
        group = synthetic.group(version=2)
        assert len(group) == {"math": 4, "code": 2}[group[0].env.name]
        traces = [trace for episode in group for trace in episode.traces]
        seen["fork"] += sum(trace.num_branches > 1 for trace in traces)
        seen["judge"] += sum(not trace.agent.trainable for trace in traces)
        seen["errored"] += sum(trace.has_error for trace in traces)
        seen["given"] += any(node.advantages for trace in traces for node in trace.nodes)
        result = ours(group)
        assert_same(result.rollouts, group_samples(group))
        assert all(len(arrays["input_ids"]) <= 256 for _, arrays in result.rollouts)
        assert all(record.policy_version == 2 for record, _ in result.rollouts)
    assert all(seen.values()), seen
