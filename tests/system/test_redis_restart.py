"""Redis dies under a running system (real redis-server processes on ports of their own).

With the persistence rlship's own Redis is started with (an append-only file synced on
every write), `rlship run` restarts it and the run completes as if nothing happened:
every step reaches every rank once, in order, byte for byte as encoded. With none, the
orchestrator notices that the run is gone, says which steps and rollouts were lost, and
stops with an error instead of hanging."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from orchestrator.commands.processes import redis_answers
from orchestrator.orchestrator import Orchestrator
from orchestrator.watchdog import STALL_CHECK_SECONDS
from tests.support.processes import REPO, Workers, python_command, running_workers
from tests.support.shiprun import deterministic_run, ship_settings, start_orchestrator, start_trainers, stop
from transport.connection import connect_redis, connect_redis_async
from transport.keys import RunKeys
from transport.zmq_sockets import free_port_pair

pytestmark = pytest.mark.timeout(300)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except redis.ConnectionError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_rlship_run_survives_its_redis_being_killed(tmp_path):
    steps, run_id = 12, "redis-killed"
    url = f"redis://127.0.0.1:{free_port_pair()}/0"
    command = [
        *python_command(), "run", "--redis-url", url, "--run-id", run_id,
        "--steps", str(steps), "--ranks", "2", "--stall-seconds", "5",
        "--output-dir", str(tmp_path / "run"), "--summary-json", str(tmp_path / "summary.json"),
    ]  # fmt: skip
    with open(tmp_path / "out.log", "wb") as out:
        run = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    client = redis.Redis.from_url(url)
    try:
        wait_for(lambda: client.hlen(RunKeys(run_id).published) >= 3, 120, "three steps published")
        os.kill(client.info("server")["process_id"], signal.SIGKILL)
        assert run.wait(180) == 0, (tmp_path / "out.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(60)

    out = (tmp_path / "out.log").read_text()
    assert f"rlship run {run_id}: no Redis answered at {url}, so this run started its own there" in out
    assert "redis exited with -9; starting it again" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_shipped"] == steps
    for rank, received in summary["ranks"].items():
        assert received["steps"] == list(range(steps)), f"rank {rank}"
        for step, checksum in zip(received["steps"], received["checksums"], strict=True):
            assert summary["sent_checksums"][f"{step}:{rank}"] == checksum, f"rank {rank} step {step}"


@pytest.fixture
def bare_redis(tmp_path: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    """A Redis that keeps nothing on disk, and a function that kills it and starts it empty."""
    port = free_port_pair()
    url = f"redis://127.0.0.1:{port}/0"
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(tmp_path)]  # fmt: skip
    server = [subprocess.Popen(command, stdout=subprocess.DEVNULL)]

    def restart_empty() -> None:
        server[0].send_signal(signal.SIGKILL)
        server[0].wait()
        server[0] = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        wait_for(lambda: redis_answers(url), 10, "redis to come back")

    wait_for(lambda: redis_answers(url), 10, "redis to start")
    yield url, restart_empty
    server[0].terminate()
    server[0].wait(10)


def test_a_redis_restarted_empty_stops_the_orchestrator_with_what_was_lost(bare_redis, run_id, tmp_path):
    url, restart_empty = bare_redis
    client = redis.Redis.from_url(url)
    (tmp_path / "workers").mkdir()
    with running_workers(url, tmp_path / "workers") as workers:
        settings = deterministic_run(client, run_id, url, workers, tmp_path / "run", 30)
        trainers = start_trainers(settings)
        log = tmp_path / "orchestrator.log"
        orchestrator = start_orchestrator(settings, log)
        try:
            wait_for(lambda: client.hlen(RunKeys(run_id).published) >= 2, 120, "two steps published")
            restart_empty()
            assert orchestrator.wait(60) == 3, log.read_text()[-3000:]
        finally:
            if orchestrator.poll() is None:
                orchestrator.kill()
            for trainer in trainers:
                trainer.terminate()
            stop(trainers)

    text = log.read_text()
    assert "Redis lost the run's state (restarted without persistence?)" in text
    lost = json.loads((Path(settings.output_dir) / "lost.json").read_text())
    first_lost = lost["steps_lost"][0] if lost["steps_lost"] else None
    assert first_lost is None or first_lost >= 2
    assert lost["records_read"] > 0
    assert client.dbsize() < 50, "the restarted Redis holds next to nothing of the run"
    assert not client.exists(RunKeys(run_id).metrics_stream)


def test_a_lost_release_message_is_enqueued_again(client, redis_url, run_id, tmp_path, caplog):
    """The orchestrator waits for each release before the next; if the task message is lost
    (as when Redis dies mid-delivery) it enqueues it again after `stall_seconds`."""
    (tmp_path / "workers").mkdir()
    pool = Workers(redis_url, tmp_path / "workers")
    settings = ship_settings(run_id, redis_url, pool, tmp_path / "run", stall_seconds=1.0)

    async def scenario() -> None:
        connection = connect_redis_async(redis_url)
        orchestrator = Orchestrator(settings, connection)
        try:
            await orchestrator.releases.schedule(0)
            assert client.llen(pool.cpu_queue) == 1
            client.delete(pool.cpu_queue)  # the message is gone; no worker ever saw it
            pool.start("cpu")
            pool.start("ship")
            await asyncio.get_running_loop().run_in_executor(None, pool.wait_ready)
            await asyncio.wait_for(orchestrator.releases.drain(), 60)
        finally:
            await connection.aclose()

    try:
        with caplog.at_level(logging.WARNING, logger="rlship.orchestrator"):
            asyncio.run(scenario())
    finally:
        pool.stop()
    assert client.hexists(RunKeys(run_id).released, 0)
    assert "step 0 not released after 1 s; enqueueing it again" in caplog.text


def test_a_stuck_step_is_enqueued_again_less_and_less_often(client, redis_url, run_id, tmp_path):
    """A step in flight without progress is enqueued again after `stall_seconds`, then after
    twice that, and so on (a stuck trainer would otherwise collect ever more retrying
    sends). No worker consumes the queue here, so every enqueue stays countable in it: in
    8.5 checks of 1 s, at 1 s a stall, it is enqueued at about 2, 4 and 8 s, not 7 times."""
    pool = Workers(redis_url, tmp_path)  # its queue names only; no worker is started
    settings = ship_settings(run_id, redis_url, pool, tmp_path / "run", stall_seconds=STALL_CHECK_SECONDS)

    async def scenario() -> None:
        connection = connect_redis_async(redis_url)
        orchestrator = Orchestrator(settings, connection)
        orchestrator.dispatcher.next_step = 1  # step 0 is in flight and nothing will ever move it
        watchdog = asyncio.create_task(orchestrator.watchdog.watch())
        try:
            await asyncio.sleep(STALL_CHECK_SECONDS * 8.5)
        finally:
            orchestrator._stopping.set()
            await watchdog
            await connection.aclose()

    try:
        asyncio.run(scenario())
        assert 2 <= client.llen(pool.cpu_queue) <= 4
    finally:
        client.delete(pool.cpu_queue)


COUNT_LUA = "redis.call('INCRBY', KEYS[1], ARGV[1]) return redis.call('GET', KEYS[1])"


def test_a_pipelines_script_survives_redis_restarting_between_its_load_and_its_send(bare_redis):
    """redis-py loads a pipeline's scripts before its first attempt only: Redis restarted
    empty after that load, the retry on the new connection must load them again, or its
    EVALSHA fails with NOSCRIPT (an `rlship run` whose Redis was killed lost a release so)."""
    url, restart_empty = bare_redis

    def restart_after(load_scripts: Callable[[], object]) -> Callable[[], object]:
        def load_then_restart() -> object:
            loaded = load_scripts()
            restart_empty()
            return loaded

        return load_then_restart

    client = connect_redis(url)
    for transaction in (False, True):
        pipe = client.pipeline(transaction=transaction)
        client.register_script(COUNT_LUA)(keys=["counted"], args=[3], client=pipe)
        pipe.set("plain", "written")
        pipe.load_scripts = restart_after(pipe.load_scripts)
        assert pipe.execute() == [b"3", True], f"transaction={transaction}"
        assert client.get("plain") == b"written"

    async def asynchronously() -> list:
        aclient = connect_redis_async(url)
        try:
            results = []
            for transaction in (False, True):
                pipe = aclient.pipeline(transaction=transaction)
                await aclient.register_script(COUNT_LUA)(keys=["counted"], args=[5], client=pipe)
                pipe.set("plain", "again")

                async def load_then_restart(load=pipe.load_scripts) -> None:
                    await load()
                    await asyncio.to_thread(restart_empty)

                pipe.load_scripts = load_then_restart
                results.append(await pipe.execute())
            return results
        finally:
            await aclient.aclose()

    assert asyncio.run(asynchronously()) == [[b"5", True], [b"5", True]]
