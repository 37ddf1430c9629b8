"""One Redis per run: an orchestrator given its Redis by `--redis-url` or by a `--config` file
keeps all of the run on it (its keys, the Celery tasks it enqueues and their events), and so
does `rlship run` with every child it starts, though the environment's REDIS_URL names
another server. Both servers are started here; the environment's one must see nothing but
this test's own reads."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest
import redis

from orchestrator.commands.config import toml_value
from tests.support.processes import REPO, python_command, running_workers
from tests.support.shiprun import ship_settings
from transport.keys import RunKeys
from transport.zmq_sockets import free_port_pair

# What this test itself sends the environment's server (redis-py introduces itself first).
OWN_COMMANDS = {"hello", "client|setinfo", "ping", "info", "dbsize", "scan"}


def commands_seen(client: redis.Redis) -> set[str]:
    return {name.removeprefix("cmdstat_") for name in client.info("commandstats")}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("given_by", ["flag", "config"])
def test_the_orchestrator_keeps_the_run_on_the_redis_it_is_given(
    start_redis, tmp_path: Path, given_by: str
) -> None:
    run_url = f"redis://{start_redis()}/0"
    environment_url = f"redis://{start_redis()}/0"
    environment_server = redis.Redis.from_url(environment_url)
    run_server = redis.Redis.from_url(run_url)
    run_id = f"one-{uuid.uuid4().hex[:8]}"
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    # The workers are children of a run: they get the URL the run resolved (as `rlship run`
    # passes it on), so they take tasks only from the run's server.
    with running_workers(run_url, log_dir) as workers:
        settings = ship_settings(run_id, run_url, workers, tmp_path, steps=2, ranks=1)
        values = {
            name: value
            for name, value in settings.model_dump(mode="json").items()
            if name in {"run_id", "steps", "ranks", "batch_size", "group_size", "seq_len", "zmq_port",
                        "output_dir", "cpu_queue", "ship_queue"}
        }  # fmt: skip
        flag = ["--redis-url", run_url] if given_by == "flag" else []
        if given_by == "config":
            values["redis_url"] = run_url
        config = tmp_path / "run.toml"
        config.write_text("".join(f"{name} = {toml_value(value)}\n" for name, value in values.items()))
        env = {**os.environ, "REDIS_URL": environment_url, "PYTHONPATH": str(REPO)}

        def start(*args: str, log: str) -> subprocess.Popen:
            return subprocess.Popen(
                python_command(*args, "--config", str(config), *flag),
                env=env,
                cwd=REPO,
                stdout=open(log_dir / f"{log}.log", "ab"),
                stderr=subprocess.STDOUT,
            )

        started = [
            start("trainer", "--rank", "0", "--idle-timeout", "60", log="trainer-0"),
            start("produce", "--groups", "200", log="producer"),
        ]
        orchestrator = start("orchestrate", log="orchestrator")
        started.append(orchestrator)
        try:
            # Until the orchestrator is done, or the environment's server gets a key (a
            # task queued there waits for a worker that never comes).
            while orchestrator.poll() is None and environment_server.dbsize() == 0:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    orchestrator.wait(0.5)
            keys_elsewhere = [key.decode() for key in environment_server.scan_iter(count=1000)]
        finally:
            for process in started:
                if process.poll() is None:
                    process.terminate()
            psutil.wait_procs([psutil.Process(p.pid) for p in started if p.poll() is None], timeout=15)
        logs = {path.name: path.read_text(errors="replace")[-2000:] for path in log_dir.glob("*.log")}
        assert keys_elsewhere == [], keys_elsewhere
        assert orchestrator.returncode == 0, logs["orchestrator.log"]
        assert commands_seen(environment_server) <= OWN_COMMANDS, commands_seen(environment_server)
        # Everything of the run is on the server it was given: its keys, the queues' bindings.
        assert run_server.hlen(RunKeys(run_id).published) == 2
        assert run_server.exists(f"_kombu.binding.{workers.cpu_queue}")
        assert any(run_server.scan_iter(match=RunKeys(run_id).run_key("*"), count=1000))


@pytest.mark.timeout(240)
def test_rlship_run_keeps_every_child_on_the_redis_its_config_names(start_redis, tmp_path: Path) -> None:
    """`rlship run` passes the Redis it resolved on to its workers, trainer ranks, producer
    and orchestrator: none of them falls back to the environment's REDIS_URL."""
    run_url = f"redis://{start_redis()}/0"
    environment_url = f"redis://{start_redis()}/0"
    run_id = f"one-{uuid.uuid4().hex[:8]}"
    values = {
        "redis_url": run_url, "run_id": run_id, "steps": 2, "ranks": 1, "batch_size": 16, "group_size": 4,
        "seq_len": 512, "zmq_port": free_port_pair(), "output_dir": str(tmp_path / "run"),
    }  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text("".join(f"{name} = {toml_value(value)}\n" for name, value in values.items()))
    done = subprocess.run(
        python_command("run", "--config", str(config)),
        env={**os.environ, "REDIS_URL": environment_url, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"rlship run {run_id}: 2 steps shipped" in done.stdout
    environment_server = redis.Redis.from_url(environment_url)
    assert list(environment_server.scan_iter(count=1000)) == []
    assert commands_seen(environment_server) <= OWN_COMMANDS, commands_seen(environment_server)
    assert redis.Redis.from_url(run_url).hlen(RunKeys(run_id).published) == 2
