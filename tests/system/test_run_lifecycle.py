"""A run's tasks and keys end with the run, and its summary says what happened.

Real `rlship run` processes (Redis, Celery workers, trainer ranks, producer, orchestrator):
stopped by SIGTERM mid-run, started again with the same id (it resumes), started a third
time (refused: that id finished). And a task of a run with no live orchestrator, taken by
a shared worker, is dropped and counted instead of retried forever."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import psutil
import pytest

from tasks.cohort import CohortBuilder
from tasks.manifest import ShipConfig, StepManifest
from tasks.ship import send
from tests.support.processes import REPO, python_command, signal_when, wait_for
from tests.support.runs import forget_run, keys_without_expiry, processes_of, run_command
from transport.zmq_sockets import free_port_pair

DEADLINE_SECONDS = 180


@pytest.mark.timeout(420)
def test_a_run_stopped_by_sigterm_leaves_nothing_behind_and_resumes(client, redis_url, tmp_path):
    run_id = f"life-{uuid.uuid4().hex[:8]}"
    port = free_port_pair()
    env = {**os.environ, "REDIS_URL": redis_url}
    published = f"rlship:{run_id}:published"
    # Steps enough that the SIGTERM lands mid-run: 40 of them once shipped in 2.2 s, all before it.
    process = subprocess.Popen(
        run_command(run_id, 400, tmp_path, port), env=env, cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    two_published = lambda: client.hlen(published) >= 2  # noqa: E731
    stdout, _ = signal_when(process, "two steps published", two_published, signal.SIGTERM)
    shipped = client.hlen(published)
    assert process.returncode == 1, stdout[-2000:]
    assert f"rlship run {run_id}: {shipped} steps shipped," in stdout, stdout[-2000:]
    assert "stopped: interrupted" in stdout and f"`rlship run --run-id {run_id}`" in stdout
    assert processes_of(run_id) == []
    assert keys_without_expiry(client, run_id) == []
    assert client.llen(f"cpu-{run_id}") == client.llen(f"ship-{run_id}") == 0
    assert not client.exists(f"rlship:{run_id}:alive")

    # The same command resumes the run: every step reaches every rank once, in order.
    again = subprocess.run(
        run_command(run_id, shipped + 2, tmp_path, port), env=env, cwd=REPO, capture_output=True, text=True,
        timeout=DEADLINE_SECONDS,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"{shipped + 2} steps shipped, {shipped} of them before this start" in again.stdout
    for rank in (0, 1):
        order = [int(s) for s in client.lrange(f"rlship:{run_id}:delivery_order:{rank}", 0, -1)]
        assert order == list(range(shipped + 2)), (rank, order)
    assert keys_without_expiry(client, run_id) == []

    # A third start with that id is refused, saying why.
    third = subprocess.run(
        run_command(run_id, shipped + 2, tmp_path, port), env=env, cwd=REPO, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert third.returncode == 2
    assert f"run id '{run_id}' was used by a run that finished ({shipped + 2} records" in third.stderr
    # So is an orchestrator alone (a second `honcho start` of a finished run).
    alone = subprocess.run(
        [*python_command(), "orchestrate", "--run-id", run_id], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert alone.returncode == 2 and "was used by a run that finished" in alone.stderr, alone.stderr
    assert processes_of(run_id) == []
    forget_run(client, run_id)


@pytest.mark.timeout(300)
def test_a_run_whose_trainer_dies_says_so_and_leaves_nothing_behind(client, redis_url, tmp_path):
    run_id = f"life-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "REDIS_URL": redis_url}
    command = run_command(run_id, 40, tmp_path, free_port_pair())
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        wait_for("a step published", lambda: client.hlen(f"rlship:{run_id}:published") >= 1)
        children = psutil.Process(process.pid).children()
        trainer = next(p for p in children if p.cmdline()[-2:] == ["--rank", "1"])
        trainer.kill()
        stdout, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    shipped = client.hlen(f"rlship:{run_id}:published")
    assert process.returncode == 1, stdout[-2000:]
    assert f"{shipped} step{'s' * (shipped != 1)} shipped," in stdout
    assert "stopped: trainer-1 exited with -9 (log in " in stdout, stdout[-2000:]
    assert processes_of(run_id) == []
    assert keys_without_expiry(client, run_id) == []
    forget_run(client, run_id)


@pytest.mark.timeout(120)
def test_a_task_of_a_run_without_a_live_orchestrator_is_dropped_and_counted(client, run_id, workers):
    """A send whose previous step was never sent would retry forever; its run has no live
    orchestrator (no alive mark), so the ship worker drops it once and counts it."""
    config = ShipConfig(ranks=1, seq_len=8, cpu_queue=workers.cpu_queue, ship_queue=workers.ship_queue)
    empty = CohortBuilder().build()
    manifest = StepManifest(run_id, step=1, prev_step=0, cut_time=time.time(), config=config,
                            effective=empty, window=empty)  # fmt: skip
    client.set(f"rlship:{run_id}:step:1:manifest", manifest.to_bytes(), ex=600)
    try:
        send.apply_async((run_id, 1, 0), queue=workers.ship_queue)
        dropped = f"rlship:{run_id}:tasks_dropped"
        wait_for("the send to be dropped", lambda: client.hget(dropped, "send"), timeout=60)
        assert client.hgetall(dropped) == {b"send": b"1"}
        assert client.ttl(dropped) > 0
        assert client.llen(workers.ship_queue) == 0
    finally:
        client.delete(f"rlship:{run_id}:step:1:manifest", f"rlship:{run_id}:tasks_dropped")
