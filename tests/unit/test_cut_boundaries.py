"""The rules of a step's cut, each at its exact boundary: one below, at, one above.

The oracle is never the helper under test. Every expected value is a literal worked out by
hand from the documented rules (docs/transports.md "Step numbering" and "Policy progress
and the gate", docs/trainers.md, docs/troubleshooting.md "Producers are admitted",
docs/record.md "Empty steps do not advance"):

- the run's step n is prime-rl's step s = n - first_step + 1; a rollout of policy version v
  trained in it is s - 1 - v = n - first_step - v steps off-policy, and is stale when that
  exceeds `max_off_policy_steps`;
- step n may be cut once the trainers' version is at least s - 1 - max_async_level
  = n - first_step - max_async_level;
- a sample with no trainable token (no loss token, or an advantage of exactly 0.0) is
  dropped, and a step that ships none is empty;
- admission: one call holds at most min(limit, max(batch, group)) rollouts; the gate leaves
  room for (steps it lets open + 1) batches plus one call less a rollout; the oldest version
  admitted is the one exactly `max_off_policy_steps` off-policy at the run's next step.

Each table row carries the hand arithmetic beside its literal; `_documented_*` below
re-derive the literals from the sentences above (not from transport.numbering), so a typo
in a table cannot pass unnoticed either.

The Redis-backed side (the cut itself, the gate waiting, the producers' admission script)
is tests/system/test_cut_boundaries.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from orchestrator.accounting import outcome_row
from orchestrator.admission import Admission
from orchestrator.groups import TRAINABLE, Outcome, decide_group
from orchestrator.ingest import Ingest
from orchestrator.records import RolloutRecord
from orchestrator.rollout_log import RolloutLog
from orchestrator.settings import RunSettings
from tasks.cohort import LABEL_COLUMNS, NUMERIC_COLUMNS, Cohort, CohortBuilder
from tasks.manifest import ShipConfig, StepManifest
from tasks.stages.finalize import FinalizedStep, StepVerdict, finalize_step, step_verdict
from tasks.stages.prune import count_trainable_tokens, has_training_signal, prune_samples
from transport.numbering import required_version, staleness

BOUNDARY_IDS = ["one-below", "at", "one-above"]


def _documented_age(step: int, version: int, first_step: int) -> int:
    """docs/trainers.md: prime-rl's step s = n - first_step + 1; a rollout of version v is
    s - 1 - v steps off-policy."""
    prime_rl_step = step - first_step + 1
    return prime_rl_step - 1 - version


def _documented_required(step: int, first_step: int, max_async_level: int) -> int:
    """docs/transports.md: step n ships once the version is at least s - 1 - max_async_level."""
    prime_rl_step = step - first_step + 1
    return prime_rl_step - 1 - max_async_level


def _record(rollout_id: str, reward: float, version: int, output_tokens: int = 3) -> RolloutRecord:
    return RolloutRecord(
        rollout_id=rollout_id,
        group_id=rollout_id.split("-")[0],
        task_id="t",
        env="math",
        policy_version=version,
        reward=reward,
        num_input_tokens=2,
        num_output_tokens=output_tokens,
    )


# -- rule 1: staleness against max_off_policy_steps ---------------------------------------

# (first_step, step, max_off_policy_steps, policy_version, steps off-policy, fate)
STALENESS_CASES = [
    # first_step 0: n - v
    pytest.param(0, 10, 2, 9, 1, TRAINABLE, id="first0-one-below"),  # 10 - 9 = 1 < 2
    pytest.param(0, 10, 2, 8, 2, TRAINABLE, id="first0-at"),  # 10 - 8 = 2 == 2
    pytest.param(0, 10, 2, 7, 3, "stale", id="first0-one-above"),  # 10 - 7 = 3 > 2
    # first_step 1 (prime-rl): s - 1 - v with s = n
    pytest.param(1, 10, 2, 8, 1, TRAINABLE, id="first1-one-below"),  # 10 - 1 - 8 = 1
    pytest.param(1, 10, 2, 7, 2, TRAINABLE, id="first1-at"),  # 10 - 1 - 7 = 2
    pytest.param(1, 10, 2, 6, 3, "stale", id="first1-one-above"),  # 10 - 1 - 6 = 3
    # max_off_policy_steps 0: only the current version trains
    pytest.param(0, 4, 0, 5, -1, TRAINABLE, id="limit0-one-below"),  # 4 - 5 = -1
    pytest.param(0, 4, 0, 4, 0, TRAINABLE, id="limit0-at"),  # 4 - 4 = 0
    pytest.param(0, 4, 0, 3, 1, "stale", id="limit0-one-above"),  # 4 - 3 = 1
    pytest.param(1, 4, 0, 3, 0, TRAINABLE, id="limit0-first1-at"),  # 4 - 1 - 3 = 0
    pytest.param(1, 4, 0, 2, 1, "stale", id="limit0-first1-one-above"),  # 4 - 1 - 2 = 1
]


@pytest.mark.parametrize(("first_step", "step", "limit", "version", "age", "fate"), STALENESS_CASES)
def test_staleness_is_counted_as_documented(first_step, step, limit, version, age, fate):
    assert age == _documented_age(step, version, first_step), "the table's own arithmetic"
    assert staleness(step, version, first_step) == age
    versions = np.array([version, version])
    assert staleness(step, versions, first_step).tolist() == [age, age], "a cohort's column too"


@pytest.mark.parametrize(("first_step", "step", "limit", "version", "age", "fate"), STALENESS_CASES)
def test_group_completion_discards_stale_rollouts_only_past_the_limit(
    first_step, step, limit, version, age, fate
):
    """orchestrator.groups.decide_group: stale means more than `limit` steps off-policy."""
    group = [_record("g-r0", 1.0, version), _record("g-r1", 0.0, version)]
    outcomes = decide_group(group, step, limit, first_step=first_step)
    assert [o.fate for o in outcomes] == [fate, fate]
    assert [o.advantage for o in outcomes] == [0.5, -0.5], "the baseline is not affected by staleness"


def _ingest(first_step: int, limit: int) -> Ingest:
    """An Ingest as the orchestrator builds it; the cut's staleness check touches no Redis."""
    settings = RunSettings(
        run_id="unit-boundaries", trainers="external", first_step=first_step, max_off_policy_steps=limit
    )
    return Ingest(
        settings,
        client=None,  # type: ignore[arg-type]  # drop_stale never reads Redis
        rollout_log=RolloutLog(None),
        stopping=asyncio.Event(),
        work=asyncio.Event(),
        next_step=lambda: 0,
        status=dict,
    )


def _pend(ingest: Ingest, rollout_id: str, version: int) -> None:
    outcome = Outcome(_record(rollout_id, 1.0, version), 0.5, TRAINABLE)
    ingest.pending.append(*outcome_row(outcome))


@pytest.mark.parametrize(("first_step", "step", "limit", "version", "age", "fate"), STALENESS_CASES)
def test_the_cut_discards_pending_rollouts_that_went_stale_only_past_the_limit(
    first_step, step, limit, version, age, fate
):
    """orchestrator.ingest.Ingest.drop_stale (called by Dispatcher.cut): a rollout trainable
    when its group completed, still pending when `step` is cut. A fresh rollout (version
    exactly `step`'s own: 0 steps off-policy) stays whatever the case."""
    ingest = _ingest(first_step, limit)
    current = step - first_step  # 0 steps off-policy: n - first_step - v = 0
    _pend(ingest, "fresh-r0", current)
    _pend(ingest, "edge-r0", version)
    removed = ingest.drop_stale(step)
    if fate == "stale":
        assert removed == ["edge-r0"]
        assert ingest.pending.rollout_ids == ["fresh-r0"]
        assert ingest.accounting.discarded["stale"] == 1
    else:
        assert removed == []
        assert ingest.pending.rollout_ids == ["fresh-r0", "edge-r0"]
        assert ingest.accounting.discarded["stale"] == 0


# -- rule 2: the policy gate's required version -------------------------------------------

# (step, max_async_level, first_step, required version: n - first_step - max_async_level)
GATE_CASES = [
    pytest.param(5, 1, 0, 4, id="step5-async1-first0"),  # 5 - 0 - 1
    pytest.param(5, 2, 1, 2, id="step5-async2-first1"),  # 5 - 1 - 2
    pytest.param(3, 0, 1, 2, id="step3-async0-first1"),  # 3 - 1 - 0: fully synchronous
    pytest.param(2, 0, 0, 2, id="step2-async0-first0"),  # 2 - 0 - 0
    pytest.param(1, 1, 1, -1, id="first-step-async1"),  # 1 - 1 - 1: opens before any version
]


@pytest.mark.parametrize(("step", "max_async_level", "first_step", "required"), GATE_CASES)
@pytest.mark.parametrize(("offset", "opens"), [(-1, False), (0, True), (1, True)], ids=BOUNDARY_IDS)
def test_a_step_may_be_cut_from_its_required_version_on(
    step, max_async_level, first_step, required, offset, opens
):
    assert required == _documented_required(step, first_step, max_async_level), "the table's arithmetic"
    version = required + offset
    assert (version >= required_version(step, first_step, max_async_level)) is opens


# -- rule 3: empty steps --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("advantage", "output_tokens", "signal"),
    [
        pytest.param(1.0, 0, False, id="tokens-one-below"),
        pytest.param(1.0, 1, True, id="tokens-at"),
        pytest.param(1.0, 2, True, id="tokens-one-above"),
        pytest.param(-5e-324, 1, True, id="advantage-tiny-negative"),
        pytest.param(0.0, 1, False, id="advantage-zero"),
        pytest.param(-0.0, 1, False, id="advantage-negative-zero"),
        pytest.param(5e-324, 1, True, id="advantage-tiny-positive"),
    ],
)
def test_a_rollout_has_a_training_signal_from_one_output_token_and_any_nonzero_advantage(
    advantage, output_tokens, signal
):
    assert has_training_signal(advantage, output_tokens) is signal


@pytest.mark.parametrize(
    ("loss_tokens", "advantage", "trainable"),
    [
        pytest.param(0, 1.0, 0, id="tokens-one-below"),
        pytest.param(1, 1.0, 1, id="tokens-at"),
        pytest.param(2, 1.0, 2, id="tokens-one-above"),
        pytest.param(1, 0.0, 0, id="advantage-zero"),
        pytest.param(1, 5e-324, 1, id="advantage-tiny"),
    ],
)
def test_trainable_tokens_are_the_loss_tokens_of_a_nonzero_advantage(loss_tokens, advantage, trainable):
    loss_mask = np.array([False] * (5 - loss_tokens) + [True] * loss_tokens)
    assert count_trainable_tokens(loss_mask, advantage) == trainable


def _finalized(trainable_tokens: list[float]) -> FinalizedStep:
    ids = [f"r{i}" for i in range(len(trainable_tokens))]
    numeric = {name: np.zeros(len(ids)) for name in NUMERIC_COLUMNS}
    numeric["trainable_tokens"] = np.array(trainable_tokens, dtype=float)
    samples = Cohort(numeric=numeric, labels={name: list(ids) for name in LABEL_COLUMNS})
    return FinalizedStep(samples=samples, failures={})


@pytest.mark.parametrize(
    ("trainable_tokens", "verdict", "pruned"),
    [  # r0 has no trainable token; r1 has 0, 1 or 2
        pytest.param([0.0, 0.0], StepVerdict(0, {"no_trainable_tokens": 2}), ["r0", "r1"], id="one-below"),
        pytest.param([0.0, 1.0], StepVerdict(1, {"no_trainable_tokens": 1}), ["r0"], id="at"),
        pytest.param([0.0, 2.0], StepVerdict(1, {"no_trainable_tokens": 1}), ["r0"], id="one-above"),
    ],
)
def test_a_sample_with_one_trainable_token_ships_and_one_with_none_is_dropped(
    trainable_tokens, verdict, pruned
):
    assert step_verdict(_finalized(trainable_tokens)) == verdict
    kept, dropped = prune_samples(_finalized(trainable_tokens).samples)
    assert dropped == pruned, "the verdict counts what prune drops"
    assert len(kept) == verdict.shipped


@pytest.mark.parametrize(
    ("shipped", "empty"),
    [
        pytest.param(0, True, id="one-below"),
        pytest.param(1, False, id="at"),
        pytest.param(2, False, id="one-above"),
    ],
)
def test_a_step_is_empty_only_when_it_ships_nothing(shipped, empty):
    assert StepVerdict(shipped=shipped, dropped={}).empty is empty


def _one_rollout_step(loss_tokens: int, advantage: float) -> tuple[StepManifest, dict[str, np.ndarray]]:
    """A cut of one 6-token rollout (2 prompt, 4 output) whose loss mask has `loss_tokens` ones."""
    builder = CohortBuilder()
    numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {
        "advantage": advantage, "policy_version": 0, "num_input_tokens": 2, "num_output_tokens": 4,
    }  # fmt: skip
    builder.append(numeric, {"rollout_id": "only"})
    cohort = builder.build()
    manifest = StepManifest(
        "unit", 0, -1, 0.0, ShipConfig(ranks=1, seq_len=8, vocab_size=100), cohort, cohort
    )
    arrays = {
        "input_ids": np.arange(1, 7, dtype=np.int32),
        "loss_mask": np.array([False] * (6 - loss_tokens) + [True] * loss_tokens),
        "inference_logprobs": np.full(6, -0.5, dtype=np.float32),
    }
    return manifest, arrays


@pytest.mark.parametrize(
    ("loss_tokens", "advantage", "shipped"),
    [
        pytest.param(0, 1.0, 0, id="tokens-one-below"),
        pytest.param(1, 1.0, 1, id="tokens-at"),
        pytest.param(2, 1.0, 1, id="tokens-one-above"),
        pytest.param(1, 0.0, 0, id="advantage-zero"),
        pytest.param(1, 1e-300, 1, id="advantage-tiny"),
    ],
)
def test_a_step_of_one_rollout_ships_it_only_with_a_trainable_token(loss_tokens, advantage, shipped):
    """Finalize, then the verdict the orchestrator reads: the whole worker-side path."""
    manifest, arrays = _one_rollout_step(loss_tokens, advantage)
    result = finalize_step(manifest, {"only": arrays})
    assert result.failures == {}
    verdict = step_verdict(result)
    assert verdict.shipped == shipped
    assert verdict.empty is (shipped == 0)
    assert verdict.dropped == ({} if shipped else {"no_trainable_tokens": 1})


@pytest.mark.parametrize(
    ("rewards", "output_tokens", "fates"),
    [
        pytest.param([0.0, 0.0], 3, ["zero_advantage"] * 2, id="advantage-zero"),
        pytest.param([1e-300, 0.0], 3, [TRAINABLE] * 2, id="advantage-tiny"),
        pytest.param([1.0, 0.0], 0, ["zero_advantage"] * 2, id="tokens-one-below"),
        pytest.param([1.0, 0.0], 1, [TRAINABLE] * 2, id="tokens-at"),
    ],
)
def test_group_completion_discards_rollouts_without_a_training_signal(rewards, output_tokens, fates):
    group = [_record(f"z-r{i}", reward, 0, output_tokens) for i, reward in enumerate(rewards)]
    assert [o.fate for o in decide_group(group, 0, 8)] == fates


# -- rule 4: admission ------------------------------------------------------------------------


def _admission(**values: int) -> Admission:
    defaults = dict(
        limit=100, batch_size=4, group_size=2, first_step=0, start_step=0, max_async_level=1,
        max_off_policy_steps=2,
    )  # fmt: skip
    return Admission(**{**defaults, **values})


@pytest.mark.parametrize(
    ("limit", "largest"),
    [  # batch 8, group 2: min(limit, max(8, 2))
        pytest.param(7, 7, id="one-below"),
        pytest.param(8, 8, id="at"),
        pytest.param(9, 8, id="one-above"),
    ],
)
def test_the_largest_call_is_a_batch_within_the_limit(limit, largest):
    assert _admission(limit=limit, batch_size=8, group_size=2).largest_call == largest
    assert _admission(limit=limit, batch_size=2, group_size=8).largest_call == largest, "or a group"


# batch 4, group 2, limit 100: largest call 4. room = (max(0, version - required + 1) + 1) * 4 + 4 - 1
GATE_ROOM_CASES = [
    # first_step 0, next step 5, max_async_level 1: required 5 - 0 - 1 = 4
    pytest.param(0, 2, 7, id="first0-clamped"),  # steps max(0, -1) = 0: 1 * 4 + 3
    pytest.param(0, 3, 7, id="first0-one-below"),  # steps 0: 1 * 4 + 3
    pytest.param(0, 4, 11, id="first0-at"),  # steps 1: 2 * 4 + 3
    pytest.param(0, 5, 15, id="first0-one-above"),  # steps 2: 3 * 4 + 3
    # first_step 1, next step 5, max_async_level 1: required 5 - 1 - 1 = 3
    pytest.param(1, 2, 7, id="first1-one-below"),
    pytest.param(1, 3, 11, id="first1-at"),
    pytest.param(1, 4, 15, id="first1-one-above"),
]


@pytest.mark.parametrize(("first_step", "version", "room"), GATE_ROOM_CASES)
def test_the_gate_leaves_room_for_a_batch_per_open_step_and_one_more(first_step, version, room):
    assert _admission(first_step=first_step, start_step=first_step).gate_room(version, 5) == room


@pytest.mark.parametrize(
    ("first_step", "next_step", "limit", "oldest"),
    [
        pytest.param(0, 10, 2, 8, id="first0"),  # 10 - 0 - 8 = 2 steps off-policy: the limit
        pytest.param(1, 10, 2, 7, id="first1"),  # 10 - 1 - 7 = 2
        pytest.param(0, 4, 0, 4, id="first0-limit0"),  # 4 - 0 - 4 = 0
        pytest.param(1, 1, 0, 0, id="first1-first-step"),  # 1 - 1 - 0 = 0
    ],
)
def test_the_oldest_fresh_version_is_exactly_the_limit_off_policy(first_step, next_step, limit, oldest):
    assert _documented_age(next_step, oldest, first_step) == limit, "the table's arithmetic"
    admission = _admission(first_step=first_step, start_step=first_step, max_off_policy_steps=limit)
    assert admission.oldest_fresh_version(next_step) == oldest
    # And admission agrees with the cut: the oldest passes decide_group, one older does not.
    fates = [
        decide_group(
            [_record("o-r0", 1.0, v), _record("o-r1", 0.0, v)], next_step, limit, first_step=first_step
        )[0].fate
        for v in (oldest + 1, oldest, oldest - 1)
        if v >= 0
    ]
    assert fates == [TRAINABLE, TRAINABLE, "stale"][: len(fates)]
