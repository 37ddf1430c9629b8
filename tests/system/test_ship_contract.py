"""The ship tasks' bookkeeping in Redis, called in this process against the real Redis (no
Celery worker): the run-wide key names, what a dropped or redundant delivery counts and logs,
what `run_stage` records and registers, where the fault hook fires, the `sending` intent mark
and the ship-problem note. Every expected key is written out by hand as `rlship:{run}:...`,
never built with `RunKeys`."""

from __future__ import annotations

import logging
import os
import socket
import time

import pytest
import redis

from tasks import faults, ship
from tasks import send as sending
from tasks.app import app
from tasks.graph import STAGES, predecessors, task_stages
from transport.keys import RunKeys
from transport.replication import Durability

LOGGER = "rlship.tasks"


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_run_state_key_names_are_the_documented_ones(run_id: str) -> None:
    # Persistent across a restart and shared with other processes (orchestrator, followers,
    # `rlship status`, workers of another version): a renamed key silently loses a restarted
    # run's checkpoint and lease, or splits a counter in two. Some are named in the README.
    state = RunKeys(run_id)
    names = {
        "published": "published",
        "released": "released",
        "totals": "totals",
        "sent_checksums": "sent_checksums",
        "stage_calls": "stage_calls",
        "redundant": "redundant_deliveries",
        "next_step": "next_step",
        "status": "status",
        "evicted": "payloads_evicted_unacknowledged",
        "interrupted_sends": "interrupted_sends",
        "checkpoint": "checkpoint",
        "followed": "followed",
        "orchestrator_lease": "orchestrator_lease",
        "run_marker": "started_at",
        "alive": "alive",
        "tasks_dropped": "tasks_dropped",
        "finished": "finished",
        "ship_problem": "ship_problem",
    }
    assert {attr: getattr(state, attr) for attr in names} == {
        attr: f"rlship:{run_id}:{name}" for attr, name in names.items()
    }
    assert state.run_id == run_id


def test_every_stage_of_the_graph_is_a_task_under_its_fixed_name_or_carried_by_one() -> None:
    # In every task message and in Flower: a renamed task strands the messages in flight.
    names = {"rlship.finalize", "rlship.metrics", "rlship.encode", "rlship.send", "rlship.publish",
             "rlship.release"}  # fmt: skip
    # And one task before any cut, outside the step's graph: a completed group's wire parts.
    assert {name for name in app.tasks if name.startswith("rlship.")} == names | {"rlship.prepare"}
    assert {stage.task_name for stage in STAGES if not stage.carried} == names
    assert {stage.name for stage in STAGES if stage.per_rank} == {"encode", "send"}
    assert [stage.name for stage in STAGES if stage.queue == "ship"] == ["send"]
    # Prune and pack run in finalize's task, after it: each has one predecessor, per step, on
    # the same queue, so the process running it has what it needs.
    assert task_stages("finalize") == ("finalize", "prune", "pack") and task_stages("encode") == ("encode",)
    for stage in (stage for stage in STAGES if stage.carried):
        (before,) = predecessors(stage.name)
        assert not stage.per_rank and not before.per_rank and stage.queue == before.queue


def test_a_task_of_an_ended_run_is_dropped_counted_and_logged(
    client: redis.Redis, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    queue = f"cpu-{run_id}"
    try:
        ship.finalize(run_id, 7)  # no `alive` mark: the run has ended; no manifest needed
        ship.finalize(run_id, 8)
        ship.metrics(run_id, 8)
        dropped = f"rlship:{run_id}:tasks_dropped"
        assert client.hgetall(dropped) == {b"finalize": b"2", b"metrics": b"1"}
        assert 0 < client.ttl(dropped) <= ship.StepContext(run_id, 7).store.ttl
        assert messages(caplog, logging.WARNING) == [
            f"run {run_id} has ended: finalize of step 7 dropped",
            f"run {run_id} has ended: finalize of step 8 dropped",
            f"run {run_id} has ended: metrics of step 8 dropped",
        ]
        assert client.llen(queue) == 0, "nothing enqueued"
        assert not client.exists(f"rlship:{run_id}:redundant_deliveries")
    finally:
        client.delete(queue)


def test_a_task_of_a_published_step_is_counted_as_redundant_and_logged(
    client: redis.Redis, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    client.set(f"rlship:{run_id}:alive", 1, ex=60)
    client.hset(f"rlship:{run_id}:published", "3", "1")
    ship.metrics(run_id, 3)
    ship.metrics(run_id, 3)
    ship.finalize(run_id, 3)
    assert client.hgetall(f"rlship:{run_id}:redundant_deliveries") == {b"metrics": b"2", b"finalize": b"1"}
    assert messages(caplog, logging.INFO) == [
        "step 3: metrics arrived after the step was published; nothing to do",
        "step 3: metrics arrived after the step was published; nothing to do",
        "step 3: finalize arrived after the step was published; nothing to do",
    ]
    assert not client.exists(f"rlship:{run_id}:tasks_dropped")


def test_run_stage_records_seconds_marks_registers_and_counts_once(
    client: redis.Redis, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    ctx = ship.StepContext(run_id, 4)
    calls = []
    before = time.perf_counter()
    ctx.run_stage("encode", lambda: calls.append(1), rank=1)
    elapsed = time.perf_counter() - before
    ctx.run_stage("encode", lambda: calls.append(2), rank=1)
    ctx.run_stage("metrics", lambda: calls.append(3))
    assert calls == [1, 3], "a stage marked done is not computed again"

    prefix = f"rlship:{run_id}:step:4:"
    times = client.hgetall(prefix + "times")
    assert set(times) == {b"encode:1", b"metrics"}
    assert 0.0 <= float(times[b"encode:1"]) <= elapsed
    assert float(client.get(prefix + "done:encode:1")) == float(times[b"encode:1"])
    assert 0 < client.ttl(prefix + "done:encode:1") <= ctx.store.ttl
    assert client.exists(prefix + "done:metrics")
    # Registered with the step, so releasing it deletes them.
    assert {prefix.encode() + k for k in (b"times", b"done:encode:1", b"done:metrics")} <= client.smembers(
        prefix + "keys"
    )
    who = f"{socket.gethostname()}:{os.getpid()}"
    assert client.hgetall(f"rlship:{run_id}:stage_calls") == {
        f"{who}:encode".encode(): b"1",
        f"{who}:metrics".encode(): b"1",
    }
    assert messages(caplog, logging.INFO) == ["step 4: encode:1 already done, re-enqueueing its successors"]


class Killed(Exception):
    pass


def test_an_armed_fault_fires_after_the_output_and_before_the_mark(
    client: redis.Redis, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real fault hook, with the kill made an exception: armed for encode of step 5, rank 1.
    monkeypatch.setattr(faults, "enabled", lambda: True)

    def kill(pid: int, sig: int) -> None:
        raise Killed(pid, sig)

    monkeypatch.setattr(faults.os, "kill", kill)
    client.hset(f"rlship:{run_id}:faults", "encode:5:1", 1)
    ctx = ship.StepContext(run_id, 5)
    outputs = []
    ctx.run_stage("encode", lambda: outputs.append("rank 0"), rank=0)  # another rank: no fault
    with pytest.raises(Killed):
        ctx.run_stage("encode", lambda: outputs.append("rank 1"), rank=1)
    assert outputs == ["rank 0", "rank 1"], "the output was computed before the fault"
    assert not client.exists(f"rlship:{run_id}:step:5:done:encode:1"), "killed before the mark"
    assert not client.hexists(f"rlship:{run_id}:faults", "encode:5:1"), "fires once"
    ctx.run_stage("encode", lambda: outputs.append("rank 1 again"), rank=1)  # the redelivery
    assert outputs[-1] == "rank 1 again" and client.exists(f"rlship:{run_id}:step:5:done:encode:1")

    client.hset(f"rlship:{run_id}:faults", "pack:6", 1)
    ship.StepContext(run_id, 5).run_stage("pack", lambda: None)  # another step: no fault
    with pytest.raises(Killed):
        ship.StepContext(run_id, 6).run_stage("pack", lambda: None)


def test_the_sending_mark_counts_a_resend_only_after_another_process_died_mid_send(
    client: redis.Redis, run_id: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    mark, interrupted = f"rlship:{run_id}:sending:1", f"rlship:{run_id}:interrupted_sends"

    def mark_sending(step: int) -> None:
        ctx = ship.StepContext(run_id, step)
        ctx.durability = Durability(0, 1000, f"rlship:{run_id}:replication_probe")  # no manifest: one Redis
        sending._mark_intents(ctx, [1])

    monkeypatch.setattr(sending, "_intents", set())  # a fresh process
    mark_sending(5)
    assert client.get(mark) == b"5"
    mark_sending(5)  # this process's own retry
    mark_sending(6)  # this process's next step
    assert client.get(mark) == b"6"
    assert not client.exists(interrupted)
    assert messages(caplog, logging.WARNING) == []

    monkeypatch.setattr(sending, "_intents", set())  # a new process finds step 6 marked, not sent
    mark_sending(6)
    mark_sending(6)
    assert client.hgetall(interrupted) == {b"6:1": b"1"}
    assert messages(caplog, logging.WARNING) == [
        "step 6 rank 1: the previous send died before marking it sent; sending again (a receiver "
        "without duplicate checks gets it twice only if that process died after the message left it)"
    ]
    monkeypatch.setattr(sending, "_intents", set())  # another new process, at the next step
    mark_sending(7)
    assert client.get(mark) == b"7" and client.hgetall(interrupted) == {b"6:1": b"1"}


def test_a_ship_problem_is_noted_for_ten_seconds_and_logged(
    client: redis.Redis, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    sending._report_ship_problem(ship.StepContext(run_id, 9), "rank 1 has not announced its address")
    key = f"rlship:{run_id}:ship_problem"
    assert client.get(key) == b"rank 1 has not announced its address"
    assert 0 < client.ttl(key) <= 10
    assert messages(caplog, logging.INFO) == ["step 9: rank 1 has not announced its address"]
