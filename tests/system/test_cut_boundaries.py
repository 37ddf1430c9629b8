"""The rules of a step's cut at their exact boundaries (one below, at, one above), where
they are enforced against the real Redis: the cut's staleness re-check
(`Dispatcher.cut` -> `Ingest.drop_stale`), the policy gate holding a step
(`PolicyGate.wait`), the take-back of an empty step (`Dispatcher.settle`) and the
producers' admission script (`RolloutProducer.for_run`).

Expected values are literals worked out by hand from the documented rules (see the
docstring of tests/unit/test_cut_boundaries.py, which holds the pure side); nothing
here calls transport.numbering to compute one. Each test runs under its own
`test-boundary-*` run id and deletes every `rlship:{run_id}*` key it made, and the run's
Celery queues (a cut enqueues its finalize task; no worker serves these queues).
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.commands.processes import delete_queues
from orchestrator.gate import PolicyGate
from orchestrator.orchestrator import Orchestrator
from orchestrator.policy import PolicyVersion
from orchestrator.producer import AdmissionRefused, RolloutProducer
from orchestrator.settings import RunSettings
from tests.support.factories import group, rollout
from transport.keys import RunKeys, StepValue

pytestmark = pytest.mark.timeout(60)

BOUNDARY_IDS = ["one-below", "at", "one-above"]


@pytest.fixture()
def boundary_run(client: redis.Redis) -> Iterator[str]:
    """A run id of this test alone; every key under it, and its queues, deleted after."""
    run_id = f"test-boundary-{uuid.uuid4().hex[:12]}"
    yield run_id
    keys = list(client.scan_iter(match=f"rlship:{run_id}*", count=1000))
    if keys:
        client.unlink(*keys)
    delete_queues(client, [f"rlship.{run_id}.cpu", f"rlship.{run_id}.ship"])
    assert not list(client.scan_iter(match=f"rlship:{run_id}*")), "the run's keys are gone"


def _settings(run_id: str, redis_url: str, tmp_path: Path, **overrides) -> RunSettings:
    values = {
        "run_id": run_id,
        "redis_url": redis_url,
        "steps": 1,
        "batch_size": 2,
        "group_size": 2,
        "seq_len": 64,
        "output_dir": tmp_path,
        "max_off_policy_steps": 2,
        "trainers": "external",  # the tests drive the cut themselves: no gate in the way
        "first_step": 0,
    }
    return RunSettings(**{**values, **overrides})


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (await result if inspect.isawaitable(result := predicate()) else result):
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _ingest_all(orchestrator: Orchestrator, records: int) -> None:
    """Run the orchestrator's ingest loop until it has read `records` records."""
    task = asyncio.create_task(orchestrator.ingest.run())
    try:
        await _until(lambda: orchestrator.ingest.accounting.arrived >= records)
    finally:
        task.cancel()


# -- rule 1: the cut re-checks staleness --------------------------------------------------

# A group of version 5 completes at step `ingested` (0 steps off-policy, trainable), waits
# pending, and step `cut` is cut: n - first_step - 5 steps off-policy by then, limit 2.
CUT_STALENESS_CASES = [
    pytest.param(0, 5, 6, False, id="first0-one-below"),  # 6 - 0 - 5 = 1
    pytest.param(0, 5, 7, False, id="first0-at"),  # 7 - 0 - 5 = 2
    pytest.param(0, 5, 8, True, id="first0-one-above"),  # 8 - 0 - 5 = 3
    pytest.param(1, 6, 7, False, id="first1-one-below"),  # 7 - 1 - 5 = 1
    pytest.param(1, 6, 8, False, id="first1-at"),  # 8 - 1 - 5 = 2
    pytest.param(1, 6, 9, True, id="first1-one-above"),  # 9 - 1 - 5 = 3
]


@pytest.mark.parametrize(("first_step", "ingested", "cut", "stale"), CUT_STALENESS_CASES)
def test_the_cut_discards_pending_rollouts_stale_by_then_only_past_the_limit(
    client, redis_url, boundary_run, tmp_path, first_step, ingested, cut, stale
):
    settings = _settings(boundary_run, redis_url, tmp_path, first_step=first_step)
    RolloutProducer(client, boundary_run).produce(group("g", [1.0, 0.0], policy_version=5))
    keys = RunKeys(boundary_run)
    payloads = [keys.rollout("g-r0"), keys.rollout("g-r1")]

    async def scenario() -> tuple[Orchestrator, object]:
        aclient = aioredis.Redis.from_url(redis_url)
        orchestrator = Orchestrator(settings, aclient)
        try:
            orchestrator.dispatcher.next_step = ingested
            await _ingest_all(orchestrator, 2)
            assert orchestrator.ingest.pending.rollout_ids == ["g-r0", "g-r1"], "fresh at completion"
            manifest = await orchestrator.dispatcher.cut(cut)
        finally:
            orchestrator.publisher.close()
            await aclient.aclose()
        return orchestrator, manifest

    orchestrator, manifest = asyncio.run(scenario())
    ingest = orchestrator.ingest
    if stale:
        assert manifest is None, "nothing left to cut"
        assert len(ingest.pending) == 0
        assert ingest.accounting.discarded["stale"] == 2
        assert client.exists(*payloads) == 0, "stale payloads are released at the cut"
        assert client.get(keys.next_step) is None, "no cut written"
    else:
        assert manifest is not None
        assert manifest.effective.labels["rollout_id"] == ["g-r0", "g-r1"]
        assert ingest.accounting.discarded["stale"] == 0
        assert client.exists(*payloads) == 2
        assert int(client.get(keys.next_step)) == cut + 1


# -- rule 2: the policy gate ----------------------------------------------------------------

# (step, max_async_level, first_step, required version = n - first_step - max_async_level)
GATE_CASES = [
    pytest.param(5, 1, 0, 4, id="step5-async1-first0"),
    pytest.param(5, 2, 1, 2, id="step5-async2-first1"),
    pytest.param(3, 0, 1, 2, id="step3-async0-first1"),
]


@pytest.mark.parametrize(("step", "max_async_level", "first_step", "required"), GATE_CASES)
@pytest.mark.parametrize("offset", [-1, 0, 1], ids=BOUNDARY_IDS)
def test_the_gate_holds_a_step_until_exactly_its_required_version(
    client, redis_url, boundary_run, tmp_path, step, max_async_level, first_step, required, offset
):
    """With the trainers' version at required + offset (rlship's acknowledgements in Redis),
    the gate lets the step through at once from `required` on; one below, it holds the step
    until the version reaches `required`, and not before."""
    settings = _settings(
        boundary_run, redis_url, tmp_path, trainers="builtin", first_step=first_step,
        max_async_level=max_async_level, replay_steps=max_async_level + 2,
    )  # fmt: skip
    keys = RunKeys(boundary_run)
    client.set(keys.policy_version, required + offset)

    async def scenario() -> float:
        aclient = aioredis.Redis.from_url(redis_url)
        try:
            policy = PolicyVersion(settings, aclient)
            gate = PolicyGate(settings, aclient, policy, asyncio.Event())
            assert await policy.update() == required + offset
            waiting = asyncio.create_task(gate.wait(step))
            await asyncio.sleep(0.3)
            if offset >= 0:
                assert waiting.done(), f"version {required + offset} opens step {step}"
                return await waiting
            assert not waiting.done(), f"version {required + offset} holds step {step}"
            # Still held while the version stands one short; the version reaching `required` opens it.
            await policy.update()
            await asyncio.sleep(0.1)
            assert not waiting.done()
            await aclient.set(keys.policy_version, required)
            await policy.update()
            return await asyncio.wait_for(waiting, 2.0)
        finally:
            await aclient.aclose()

    waited = asyncio.run(scenario())
    if offset >= 0:
        assert waited == 0.0
    else:
        assert waited >= 0.3


# -- rule 3: an empty step is cut again --------------------------------------------------------


@pytest.mark.parametrize(
    ("shipped", "taken_back"),
    [
        pytest.param(0, True, id="one-below"),
        pytest.param(1, False, id="at"),
        pytest.param(2, False, id="one-above"),
    ],
)
def test_a_cut_that_ships_nothing_is_cut_again_and_one_that_ships_one_rollout_is_kept(
    client, redis_url, boundary_run, tmp_path, shipped, taken_back
):
    """The verdict finalize writes (rollouts that will ship, dropped by reason), read by the
    orchestrator before its next cut: shipping 0 takes the cut back under the same number;
    shipping 1 (the smallest batch that is not empty) keeps it."""
    settings = _settings(boundary_run, redis_url, tmp_path, batch_size=2)
    RolloutProducer(client, boundary_run).produce(group("e", [1.0, 0.0], policy_version=3))
    keys = RunKeys(boundary_run)
    step = 3
    verdict = {"shipped": shipped, "dropped": {"no_trainable_tokens": 2 - shipped}}

    async def scenario() -> Orchestrator:
        aclient = aioredis.Redis.from_url(redis_url)
        orchestrator = Orchestrator(settings, aclient)
        try:
            orchestrator.dispatcher.next_step = step
            await _ingest_all(orchestrator, 2)
            assert await orchestrator.dispatcher.cut(step) is not None
            assert int(await aclient.get(keys.next_step)) == step + 1
            await aclient.set(keys.step(step, StepValue.VERDICT), msgpack.packb(verdict), ex=60)
            await asyncio.wait_for(orchestrator.dispatcher.settle(step), 5.0)
        finally:
            orchestrator.publisher.close()
            await aclient.aclose()
        return orchestrator

    orchestrator = asyncio.run(scenario())
    discarded = orchestrator.ingest.accounting.discarded
    if taken_back:
        assert int(client.get(keys.next_step)) == step, "the same number is cut again"
        assert orchestrator.dispatcher.next_step == step
        assert discarded["empty_step"] == 2
        assert client.exists(keys.step(step, StepValue.MANIFEST)) == 0, "the cut's keys are deleted"
    else:
        assert int(client.get(keys.next_step)) == step + 1, "the step stands"
        assert discarded["empty_step"] == 0
        assert client.exists(keys.step(step, StepValue.MANIFEST)) == 1


# -- rule 4: admission ------------------------------------------------------------------------


def _run_state(client: redis.Redis, run_id: str, *, backlog: int, version: int, next_step: int) -> None:
    """What the orchestrator would have written: `backlog` rollouts produced and not yet
    accounted, the trainers' version as it knows it, and the next step to cut."""
    keys = RunKeys(run_id)
    client.set(keys.produced, backlog)
    client.set(keys.accounted, 0)
    client.set(keys.known_policy_version, version)
    client.set(keys.next_step, next_step)


def _outcome(producer: RolloutProducer, rollouts, partial_groups: bool = False) -> str:
    try:
        producer.produce(rollouts, partial_groups=partial_groups)
    except AdmissionRefused as refused:
        return refused.reason
    return "written"


def _written(client: redis.Redis, run_id: str) -> tuple[int, int]:
    keys = RunKeys(run_id)
    return client.xlen(keys.rollout_stream), len(list(client.scan_iter(match=keys.rollout("*"))))


@pytest.mark.parametrize(
    ("backlog", "outcome"),
    [  # limit 10, a call of 2: backlog + call = 9, 10, 11
        pytest.param(7, "written", id="one-below"),
        pytest.param(8, "written", id="at"),
        pytest.param(9, "backlog", id="one-above"),
    ],
)
def test_a_call_is_admitted_up_to_exactly_the_outstanding_limit(
    client, redis_url, boundary_run, tmp_path, backlog, outcome
):
    producer = RolloutProducer.for_run(
        client,
        _settings(boundary_run, redis_url, tmp_path, batch_size=4, group_size=2, max_outstanding_rollouts=10),
    )
    # Version 100 at step 0: the gate's room is far above the limit.
    _run_state(client, boundary_run, backlog=backlog, version=100, next_step=0)
    assert _outcome(producer, group("b", [1.0, 0.0])) == outcome
    produced = int(client.get(RunKeys(boundary_run).produced))
    if outcome == "written":
        assert produced == backlog + 2 and _written(client, boundary_run) == (2, 2)
    else:
        assert produced == backlog and _written(client, boundary_run) == (0, 0), "nothing written"


# (first_step, trainers' version, backlog, outcome). Batch 4, group 2, limit 100 (largest call
# 4), max_async_level 1, next step 5: required 5 - first_step - 1; room =
# (max(0, version - required + 1) + 1) * 4 + 4 - 1. A call of 2.
GATE_ROOM_CASES = [
    # first_step 0: required 4; version 3 (the gate holds step 5): room 1 * 4 + 3 = 7
    pytest.param(0, 3, 4, "written", id="first0-held-one-below"),  # 4 + 2 = 6
    pytest.param(0, 3, 5, "written", id="first0-held-at"),  # 5 + 2 = 7
    pytest.param(0, 3, 6, "gate_held", id="first0-held-one-above"),  # 5 + 2 = 8
    # first_step 0, version 2 (two short): steps max(0, -1) = 0, still room 7
    pytest.param(0, 2, 5, "written", id="first0-clamped-at"),  # 7
    pytest.param(0, 2, 6, "gate_held", id="first0-clamped-one-above"),  # 8
    # first_step 0, version 4 (step 5 opens): room 2 * 4 + 3 = 11
    pytest.param(0, 4, 8, "written", id="first0-open-one-below"),  # 10
    pytest.param(0, 4, 9, "written", id="first0-open-at"),  # 11
    pytest.param(0, 4, 10, "gate_held", id="first0-open-one-above"),  # 12
    # first_step 1: required 3; version 2 (held): room 7
    pytest.param(1, 2, 4, "written", id="first1-held-one-below"),
    pytest.param(1, 2, 5, "written", id="first1-held-at"),
    pytest.param(1, 2, 6, "gate_held", id="first1-held-one-above"),
    # first_step 1, version 3 (open): room 11
    pytest.param(1, 3, 8, "written", id="first1-open-one-below"),
    pytest.param(1, 3, 9, "written", id="first1-open-at"),
    pytest.param(1, 3, 10, "gate_held", id="first1-open-one-above"),
]


@pytest.mark.parametrize(("first_step", "version", "backlog", "outcome"), GATE_ROOM_CASES)
def test_a_call_is_admitted_up_to_exactly_the_room_the_gate_leaves(
    client, redis_url, boundary_run, tmp_path, first_step, version, backlog, outcome
):
    settings = _settings(
        boundary_run, redis_url, tmp_path, first_step=first_step, batch_size=4, group_size=2,
        max_outstanding_rollouts=100, max_async_level=1, max_off_policy_steps=8,
    )  # fmt: skip
    producer = RolloutProducer.for_run(client, settings)
    _run_state(client, boundary_run, backlog=backlog, version=version, next_step=5)
    assert _outcome(producer, group("h", [1.0, 0.0], policy_version=version)) == outcome
    assert _written(client, boundary_run) == ((2, 2) if outcome == "written" else (0, 0))


# (first_step, policy version stamped, outcome). Next step 10, max_off_policy_steps 2:
# oldest fresh version 10 - first_step - 2.
STALE_CASES = [
    pytest.param(0, 7, "would_be_stale", id="first0-one-below"),  # 10 - 0 - 7 = 3 off-policy
    pytest.param(0, 8, "written", id="first0-at"),  # 2
    pytest.param(0, 9, "written", id="first0-one-above"),  # 1
    pytest.param(1, 6, "would_be_stale", id="first1-one-below"),  # 10 - 1 - 6 = 3
    pytest.param(1, 7, "written", id="first1-at"),  # 2
    pytest.param(1, 8, "written", id="first1-one-above"),  # 1
]


@pytest.mark.parametrize(("first_step", "version", "outcome"), STALE_CASES)
def test_a_rollout_is_admitted_from_exactly_the_oldest_fresh_version_on(
    client, redis_url, boundary_run, tmp_path, first_step, version, outcome
):
    settings = _settings(
        boundary_run, redis_url, tmp_path, first_step=first_step, batch_size=4, group_size=2,
        max_outstanding_rollouts=100, max_off_policy_steps=2,
    )  # fmt: skip
    producer = RolloutProducer.for_run(client, settings)
    _run_state(client, boundary_run, backlog=0, version=100, next_step=10)
    # One fresh rollout beside it: the whole call is refused for the one stale rollout.
    rollouts = [
        rollout("s-r0", "s", 1.0, policy_version=9),
        rollout("s-r1", "s", 0.0, policy_version=version),
    ]
    assert _outcome(producer, rollouts) == outcome
    assert _written(client, boundary_run) == ((2, 2) if outcome == "written" else (0, 0))


@pytest.mark.parametrize(
    ("size", "outcome"),
    [  # batch 4, group 2, limit 100: at most max(4, 2) = 4 rollouts per call
        pytest.param(3, "written", id="one-below"),
        pytest.param(4, "written", id="at"),
        pytest.param(5, "too_large", id="one-above"),
    ],
)
def test_a_call_holds_at_most_the_largest_call(client, redis_url, boundary_run, tmp_path, size, outcome):
    settings = _settings(
        boundary_run, redis_url, tmp_path, batch_size=4, group_size=2, max_outstanding_rollouts=100
    )
    producer = RolloutProducer.for_run(client, settings)
    _run_state(client, boundary_run, backlog=0, version=100, next_step=0)
    # Groups of two; an odd call leaves its last group to a later call.
    rollouts = [rollout(f"c-r{i}", f"c{i // 2}", float(i % 2)) for i in range(size)]
    assert _outcome(producer, rollouts, partial_groups=True) == outcome
    assert _written(client, boundary_run) == ((size, size) if outcome == "written" else (0, 0))
