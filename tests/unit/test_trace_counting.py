"""The 559b447 record's counting units by hand: `traces` folds a verifiers trace's branches
(rollouts of one `episode_id` and `trace_id`) into one trace with the trace's own counts, a
rollout of no trace is a trace of one branch; `episode_sums` sums traces by `episode_id`, a
rollout of no episode is an episode of its own; `rlship.verifiers`' trace counts are
verifiers' own."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.cohort import NUMERIC_COLUMNS, TRACE_PREFIX, CohortBuilder
from tasks.stages.names_559b447 import episode_sums, traces


def row(builder: CohortBuilder, rollout: str, tokens: tuple[int, int], turns: int = 1, episode: str = "",
        trace: tuple[str, int, int, int, int] | None = None, **flags: float) -> None:  # fmt: skip
    numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {
        "num_input_tokens": tokens[0],
        "num_output_tokens": tokens[1],
    }
    numeric |= {"num_turns": turns, **flags}
    labels = {"rollout_id": rollout, "env": "math", "group_id": "g", "episode_id": episode}
    if trace is not None:
        name, inputs, outputs, total, branches = trace
        labels["trace_id"] = name
        numeric |= {f"{TRACE_PREFIX}num_input_tokens": inputs, f"{TRACE_PREFIX}num_output_tokens": outputs}
        numeric |= {f"{TRACE_PREFIX}num_total_tokens": total, f"{TRACE_PREFIX}num_branches": branches}
    builder.append(numeric, labels)


def test_branches_fold_into_traces_and_traces_into_episodes() -> None:
    cohort = CohortBuilder()
    t1 = ("t1", 10, 8, 14, 3)  # three branches, the third with nothing left to train
    row(cohort, "e1/t1/0", (6, 4), turns=3, episode="e1", trace=t1, is_trainable=1.0)
    row(cohort, "e1/t1/1", (9, 4), turns=3, episode="e1", trace=t1)
    row(cohort, "e1/t2", (0, 0), episode="e1", trace=("t2", 5, 2, 7, 1), has_error=1.0)  # errored
    row(cohort, "plain", (3, 4), turns=2)
    row(cohort, "e2/a", (1, 1), episode="e2")  # an episode's rollouts of no trace: one trace each
    row(cohort, "e2/b", (2, 2), episode="e2", cancelled=1.0)
    row(cohort, "e3/t1/0", (4, 4), episode="e3", trace=("t1", 4, 4, 8, 1))  # another episode's t1
    folded = traces(cohort.build())
    assert folded.labels["rollout_id"] == ["e1/t1/0", "e1/t2", "plain", "e2/a", "e2/b", "e3/t1/0"]
    assert folded.numeric["num_input_tokens"].tolist() == [10, 5, 3, 1, 2, 4]
    assert folded.numeric["num_output_tokens"].tolist() == [8, 2, 4, 1, 2, 4]
    assert folded.numeric["num_total_tokens"].tolist() == [14, 7, 7, 2, 4, 8]
    assert folded.numeric["num_branches"].tolist() == [3, 1, 1, 1, 1, 1]
    assert folded.numeric["is_trainable"].tolist() == [1, 0, 0, 0, 0, 0], "a trace trains if a branch does"
    assert folded.numeric["has_error"].tolist() == [0, 1, 0, 0, 0, 0]
    episodes = episode_sums(folded)
    assert episodes["num_total_tokens"].tolist() == [21, 7, 6, 8]
    assert episodes["num_input_tokens"].tolist() == [15, 3, 3, 4]
    assert episodes["num_turns"].tolist() == [4, 2, 2, 1]
    assert episodes["num_branches"].tolist() == [4, 1, 2, 1]
    assert episodes["has_error"].tolist() == [1, 0, 0, 0]
    assert episodes["cancelled"].tolist() == [0, 0, 1, 0]


def test_no_rollouts_no_traces() -> None:
    folded = traces(CohortBuilder().build())
    assert len(folded) == 0
    assert episode_sums(folded)["num_branches"].tolist() == []


def test_plain_rollouts_are_episodes_of_one_trace_of_one_branch() -> None:
    cohort = CohortBuilder()
    row(cohort, "a", (3, 4), turns=2, has_error=1.0)
    row(cohort, "b", (5, 1))
    folded = traces(cohort.build())
    assert folded.labels["rollout_id"] == ["a", "b"]
    assert folded.numeric["num_total_tokens"].tolist() == [7, 6]
    assert folded.numeric["num_branches"].tolist() == [1, 1]
    episodes = episode_sums(folded)
    assert episodes["num_turns"].tolist() == [2, 1]
    assert episodes["has_error"].tolist() == [1, 0]


def test_a_trace_counts_as_verifiers_counts_it() -> None:
    """`rlship.verifiers`' one-pass counts are verifiers 0.4.0's `Trace` properties, for every
    kind of trace: forked (a shared call once in input and total, output per branch),
    multi-turn, multimodal, errored, a judge's, and one with no node at all."""
    vf = pytest.importorskip("verifiers.v1")
    from rlship.verifiers.trace_counts import trace_counts
    from tests.support import episodes as build

    rng = np.random.default_rng(3)
    kinds = [build.forked(rng, 1.0), build.multi_turn_tools(rng, 0.0), build.multimodal(rng, 1.0)]
    kinds += [build.errored(rng), *build.judged(rng, 1.0), build.single_turn(rng, 0.5)]
    kinds.append(vf.Trace(task=kinds[0].task, agent=kinds[0].agent))
    for trace in kinds:
        names = ("num_input_tokens", "num_output_tokens", "num_total_tokens", "num_branches")
        assert trace_counts(trace, "t") == {"id": "t", **{name: getattr(trace, name) for name in names}}
    assert kinds[0].num_branches == 2 and kinds[0].num_output_tokens > kinds[0].usage.completion_tokens
