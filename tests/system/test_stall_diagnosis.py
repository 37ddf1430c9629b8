"""A stuck run says why within seconds: the orchestrator's watchdog names the cause in its
status (what `rlship run` shows) and its log. Real Redis, the session's Celery workers, real
ZMQ sockets and trainer ranks; each cause is made for real (a port held by another socket,
a rank never started, a queue nobody consumes, a Redis out of memory)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.diagnosis import redis_out_of_memory
from orchestrator.orchestrator import Orchestrator
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings, settings_to_env
from tests.support.factories import group
from tests.support.processes import REPO, python_command, refused, session_queue
from tests.support.shiprun import ship_settings, start_trainers, stop

DEADLINE_SECONDS = 60


def produce_one_step(client: redis.Redis, settings: RunSettings) -> None:
    producer = RolloutProducer.for_run(client, settings)
    for index in range(settings.batch_size // settings.group_size + 1):
        producer.produce(group(f"g{index}", [1.0, 0.0, 1.0, 0.0]))


async def first_stall_reason(settings: RunSettings) -> str:
    """Run the orchestrator until its status names a stall reason; then stop it."""
    client = aioredis.Redis.from_url(settings.redis_url)
    orchestrator = Orchestrator(settings, client)
    run = asyncio.create_task(orchestrator.run())
    try:
        deadline = time.monotonic() + DEADLINE_SECONDS
        while time.monotonic() < deadline and not run.done():
            reason = await client.hget(f"rlship:{settings.run_id}:status", "stall_reason")
            if reason:
                return reason.decode()
            await asyncio.sleep(0.1)
        pytest.fail("no stall reason in the status within the deadline")
    finally:
        orchestrator._abort(RuntimeError("test over"))
        with contextlib.suppress(RuntimeError):
            await run
        await client.aclose()


def end_run(client: redis.Redis, run_id: str) -> None:
    """Without the alive mark the session's workers drop what is left of the run."""
    client.delete(f"rlship:{run_id}:alive")
    for key in client.scan_iter(match=f"rlship:{run_id}:*"):
        client.expire(key, 60)


@pytest.mark.timeout(180)
def test_a_zmq_port_held_by_another_process_stops_the_run_naming_it(
    client, redis_url, run_id, workers, tmp_path
):
    """The ship worker cannot bind the READY port (as Flower once held 5556): `rlship
    orchestrate` stops within seconds, in one line naming the address and the process that
    holds it (this test's), exit 2; it does not wait for the port."""
    settings = ship_settings(run_id, redis_url, workers, tmp_path, steps=1, batch_size=8, group_size=4)
    produce_one_step(client, settings)
    try:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", settings.zmq_port + 1))
            holder.listen()
            started = time.monotonic()
            done = subprocess.run(
                python_command("orchestrate"),
                env={**os.environ, **settings_to_env(settings)},
                cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_SECONDS,
            )  # fmt: skip
            seconds = time.monotonic() - started
    finally:
        end_run(client, run_id)
    assert done.returncode == 2, done.stderr[-2000:]
    line = refused(done, f"run {run_id} stopped", f"cannot bind 127.0.0.1:{settings.zmq_port}")
    assert f"and the READY port {settings.zmq_port + 1}: Address already in use" in line
    assert f"held by {settings.zmq_port + 1}: pid {os.getpid()}" in line, "the holder is named"
    assert seconds < DEADLINE_SECONDS / 2, f"stopped after {seconds:.0f} s, not within seconds"


@pytest.mark.timeout(180)
def test_with_bind_wait_seconds_the_run_waits_for_the_port_and_ships(
    client, redis_url, run_id, workers, tmp_path
):
    """Asked to wait for the port (bind_wait_seconds), the run says it is waiting, and ships
    once the holder lets go."""
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=1, batch_size=8, group_size=4, bind_wait_seconds=120
    )
    produce_one_step(client, settings)
    trainers = start_trainers(settings)
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", settings.zmq_port))
        holder.listen()
        reason = asyncio.run(first_stall_reason(settings))
        holder.close()
        summary = asyncio.run(Orchestrator(settings, aioredis.Redis.from_url(redis_url)).run())
        stop(trainers)
    finally:
        holder.close()
        end_run(client, run_id)
        for trainer in trainers:
            trainer.terminate()
        stop(trainers)
    assert f"cannot bind 127.0.0.1:{settings.zmq_port}" in reason
    assert "waiting up to 120 s (bind_wait_seconds)" in reason
    assert summary["steps_shipped"] == 1


@pytest.mark.timeout(180)
def test_a_rank_that_never_announced_is_named(client, redis_url, run_id, workers, tmp_path):
    settings = ship_settings(run_id, redis_url, workers, tmp_path, steps=1, batch_size=8, group_size=4)
    produce_one_step(client, settings)
    trainers = start_trainers(settings, ranks=[0])
    try:
        reason = asyncio.run(first_stall_reason(settings))
    finally:
        end_run(client, run_id)
        for trainer in trainers:
            trainer.terminate()
        stop(trainers)
    assert f"trainer rank 1 has not announced READY to 127.0.0.1:{settings.zmq_port + 1}" in reason


@pytest.mark.timeout(180)
def test_a_queue_no_worker_consumes_is_named(client, redis_url, run_id, workers, tmp_path):
    nobody = session_queue(f"nobody-{run_id}")
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=1, batch_size=8, group_size=4, cpu_queue=nobody
    )
    produce_one_step(client, settings)
    try:
        reason = asyncio.run(first_stall_reason(settings))
    finally:
        end_run(client, run_id)
        client.delete(nobody)
    # The step's finalize and, from before its cut, the prepare of its two groups (read by
    # the orchestrator in one turn: the producer wrote them first).
    assert f"no worker consumes queue '{nobody}' (2 task(s) waiting)" in reason


@pytest.mark.timeout(120)
def test_a_redis_out_of_memory_stops_the_orchestrator_saying_so(start_redis, tmp_path):
    address = start_redis("--maxmemory-policy", "noeviction")
    url = f"redis://{address}/0"
    small = redis.Redis.from_url(url)
    settings = RunSettings(run_id="oom", redis_url=url, batch_size=8, group_size=4, output_dir=tmp_path)
    produce_one_step(small, settings)
    small.config_set("maxmemory", small.info("memory")["used_memory"])  # full: every write is refused
    done = subprocess.run(
        [*python_command(), "orchestrate", "--run-id", "oom", "--redis-url", url,
         "--output-dir", str(tmp_path), "--batch-size", "8", "--group-size", "4"],
        env={**os.environ}, cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_SECONDS,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    refused(done, f"Redis at redis://{address}/0 is out of memory", "maxmemory")
    assert not Path(tmp_path / "lost.json").exists()


def test_the_diagnosis_names_a_redis_that_refused_writes_for_memory(start_redis):
    client = redis.Redis.from_url(f"redis://{start_redis('--maxmemory-policy', 'noeviction')}/0")
    assert redis_out_of_memory(client) is None
    client.config_set("maxmemory", client.info("memory")["used_memory"])
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("rlship:oom:rollout:x", b"x" * 100_000)
    reason = redis_out_of_memory(client)
    assert reason is not None and reason.startswith("Redis is out of memory") and "1 writes refused" in reason
