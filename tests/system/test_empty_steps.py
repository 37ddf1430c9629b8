"""A cut whose rollouts the workers all drop ships nothing and does not advance the step
(prime-rl's semantics): real Redis, real Celery workers and trainer ranks. The oracle is
what the test wrote: which groups it corrupted, and so which cut must come back empty."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis

from orchestrator.dispatcher import Dispatcher
from orchestrator.producer import RolloutProducer
from orchestrator.settings import settings_to_env
from tasks.cohort import LABEL_COLUMNS, NUMERIC_COLUMNS, Cohort
from tasks.ship import StepContext
from tasks.stages.finalize import FinalizedStep, StepVerdict, step_verdict
from tests.support.factories import group
from tests.support.processes import REPO, python_command
from tests.support.runs import keys_without_expiry
from tests.support.shiprun import (
    delivered,
    metrics_lines,
    open_policy_gate,
    run_orchestrator,
    ship,
    ship_settings,
)
from transport.arrays_blob import pack_arrays
from transport.keys import RunKeys
from transport.store import PayloadStore

GROUP_SIZE = 4
BATCH = 8  # two groups per step


def produce_groups(client: redis.Redis, run_id: str, count: int, corrupt: set[int]) -> list[list[int]]:
    """`count` groups of trainable rollouts, in order; the arrays of the groups in `corrupt`
    are damaged after the producer's checks (input_ids one token short of the record).
    Returns each group's input ids (of its first rollout), to find them on the wire."""
    producer = RolloutProducer(client, run_id)
    store = PayloadStore(client, run_id)
    first_ids = []
    for index in range(count):
        rollouts = group(f"e{index}", [1.0, 0.0, 1.0, 0.0], num_output_tokens=10 + index)
        producer.produce(rollouts)
        first_ids.append(rollouts[0][1]["input_ids"].tolist())
        if index in corrupt:
            for record, arrays in rollouts:
                damaged = {**arrays, "input_ids": arrays["input_ids"][:-1]}
                client.set(store.keys.rollout(record.rollout_id), pack_arrays(damaged), keepttl=True)
    return first_ids


@pytest.mark.timeout(180)
@pytest.mark.parametrize("max_async_level", [0, 1])
def test_an_empty_cut_is_cut_again_under_the_same_number(
    client, redis_url, run_id, workers, tmp_path, max_async_level
):
    # Groups are cut in the order written, two per step: groups 2 and 3 are the second cut.
    # With max_async_level 0 the empty step alone fills the steps in flight.
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=3, batch_size=BATCH, group_size=GROUP_SIZE,
        transport="fs", max_off_policy_steps=100, max_async_level=max_async_level,
        record_names="rlship-1",  # rlship-1: its progress/rollouts counts the shipped rollouts
    )  # fmt: skip
    first_ids = produce_groups(client, run_id, 8, corrupt={2, 3})
    result = ship(settings, produce=False)

    records = metrics_lines(settings)
    assert [int(r["step"]) for r in records] == [0, 1, 2], "no record for the empty cut, none skipped"
    assert [r["progress/rollouts"] for r in records] == [8.0, 8.0, 8.0], "no padding-only step"
    assert [r["empty_step/consecutive"] for r in records] == [0.0, 1.0, 0.0]
    assert [r["empty_step/total"] for r in records] == [0.0, 1.0, 1.0]
    last = records[-1]
    assert last["accounting/discarded/empty_step"] == 8.0, "the empty cut's rollouts: discarded"
    assert last["accounting/dropped_by_workers"] == 0.0, "no record counts them as dropped"
    assert all(r["accounting/balanced"] == 1.0 for r in records)
    arrived = last["accounting/arrived"]
    assert arrived == 32.0
    assert arrived == last["accounting/discarded"] + last["accounting/shipped"] + last["accounting/pending"]
    assert result.summary["empty_steps"] == 1

    # Each rank got steps 0, 1, 2 once, in order; step 1 holds groups 4 and 5 (the re-cut).
    _, counts = delivered(client, run_id, settings.ranks)
    for rank in range(settings.ranks):
        assert counts[rank] == {0: 1, 1: 1, 2: 1}
        order = [int(s) for s in client.lrange(RunKeys(run_id).delivery_order(rank), 0, -1)]
        assert order == [0, 1, 2]
    rollouts = Path(settings.output_dir) / "rollouts"
    assert sorted(p.name for p in rollouts.glob("step_*")) == ["step_0", "step_1", "step_2"]
    tokens = [
        token
        for rank in range(settings.ranks)
        for batch in msgpack.unpackb((rollouts / "step_1" / f"rank_{rank}.bin").read_bytes())
        for token in batch[0]
    ]
    for index, ids in enumerate(first_ids[:6]):
        found = any(tokens[i : i + len(ids)] == ids for i in range(len(tokens) - len(ids) + 1))
        assert found == (index in (4, 5)), f"group {index} in step 1: {found}"
    assert keys_without_expiry(client, run_id) == []


@pytest.mark.timeout(180)
def test_every_cut_empty_stops_the_run_naming_the_cause(client, redis_url, run_id, workers, tmp_path):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=5, batch_size=BATCH, group_size=GROUP_SIZE,
        transport="fs", trainers="external", first_step=0, max_empty_steps=3,
    )  # fmt: skip
    produce_groups(client, run_id, 8, corrupt=set(range(8)))
    env = {**os.environ, **settings_to_env(settings), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        python_command("orchestrate"), env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 4, done.stderr
    assert (
        "3 consecutive steps had every rollout dropped by the workers (last: step 0, 8 dropped, "
        "reason input_ids 8)" in done.stderr
    ), done.stderr
    keys = RunKeys(run_id)
    assert client.xlen(keys.metrics_stream) == 0, "no record"
    assert not (Path(settings.output_dir) / "rollouts").exists(), "no payload"
    assert client.llen(settings.cpu_queue) == 0 and client.llen(settings.ship_queue) == 0, "no task queued"
    assert keys_without_expiry(client, run_id) == []
    assert not client.exists(keys.rollout_stream) and not list(client.scan_iter(keys.rollout("*")))


def _finalized(trainable_tokens: list[float], failures: dict[str, str]) -> FinalizedStep:
    ids = [f"r{i}" for i in range(len(trainable_tokens))]
    numeric = {name: np.zeros(len(ids)) for name in NUMERIC_COLUMNS}
    numeric["trainable_tokens"] = np.array(trainable_tokens, dtype=float)
    samples = Cohort(numeric=numeric, labels={name: list(ids) for name in LABEL_COLUMNS})
    return FinalizedStep(samples=samples, failures=failures)


def test_the_verdict_counts_what_prune_will_keep() -> None:
    failures = {"x1": "input_ids: length 3, the record says 4 tokens", "x2": "payload: not found"}
    assert step_verdict(_finalized([5, 0, 2], failures)) == StepVerdict(
        shipped=2, dropped={"input_ids": 1, "payload": 1, "no_trainable_tokens": 1}
    )
    empty = step_verdict(_finalized([0, 0], {"x": "loss_mask: dtype float32, expected bool"}))
    assert empty.empty and empty.dropped == {"no_trainable_tokens": 2, "loss_mask": 1}
    assert StepVerdict.from_wire(empty.to_wire()) == empty
    assert not step_verdict(_finalized([1], {})).empty


def test_a_finalize_overtaken_by_a_new_cut_of_its_step_writes_nothing(client, run_id) -> None:
    """A copy of finalize still computing the cut that was found empty must not write its
    verdict, samples or mark over the new cut of the same step number."""
    ctx = StepContext(run_id, 0)
    manifest_key, verdict_key = ctx.keys.step(0, "manifest"), ctx.keys.step(0, "verdict")
    mark = ctx.keys.step(0, "done:finalize")
    client.set(manifest_key, b"the empty cut", ex=60)
    empty = StepVerdict(shipped=0, dropped={"input_ids": 8}).to_wire()

    def overtaken() -> dict:
        client.set(manifest_key, b"the new cut", ex=60)  # taken back and cut again meanwhile
        return {"verdict": empty}

    assert ctx.run_stage("finalize", overtaken, watch=manifest_key) is False
    assert client.exists(verdict_key, mark) == 0
    assert ctx.run_stage("finalize", lambda: {"verdict": empty}, watch=manifest_key) is True
    assert StepVerdict.from_wire(ctx.get("verdict")) == StepVerdict(0, {"input_ids": 8})
    assert client.exists(mark) and client.ttl(verdict_key) > 0


class Killed(RuntimeError):
    """Stands in for an orchestrator that died right after a cut."""


@pytest.mark.timeout(180)
def test_a_restarted_orchestrator_takes_back_its_predecessors_empty_cut(
    client, redis_url, run_id, workers, tmp_path, monkeypatch
):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=2, batch_size=BATCH, group_size=GROUP_SIZE,
        transport="fs", trainers="external", first_step=0, max_off_policy_steps=100,
    )  # fmt: skip
    produce_groups(client, run_id, 6, corrupt={0, 1})
    open_policy_gate(settings)  # the files are read afterwards: no trainer announces a policy

    async def die_before_the_verdict(self: Dispatcher, step: int) -> None:
        self.on_fatal(Killed(f"killed after cutting step {step}"))

    with monkeypatch.context() as patch:
        patch.setattr(Dispatcher, "settle", die_before_the_verdict)
        with pytest.raises(Killed):
            asyncio.run(run_orchestrator(settings))
    assert int(client.get(RunKeys(run_id).run_key("next_step"))) == 1, "step 0 was cut"
    result = asyncio.run(run_orchestrator(settings))  # resumes the run

    records = metrics_lines(settings)
    assert [int(r["step"]) for r in records] == [0, 1]
    assert records[-1]["accounting/discarded/empty_step"] == 8.0
    assert all(r["accounting/balanced"] == 1.0 for r in records)
    assert result.summary["empty_steps"] == 1
    rollouts = Path(settings.output_dir) / "rollouts"
    assert sorted(p.name for p in rollouts.glob("step_*")) == ["step_0", "step_1"]
