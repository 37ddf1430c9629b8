"""Operator mistakes stop a command at once, in one or two lines that name the cause (no
traceback, no secret), with a non-zero exit, and leave nothing running. Each case runs the
real `rlship` command against real Redis servers; a command that hangs fails the test at
the subprocess deadline."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from orchestrator.settings import RunSettings
from tests.support.compose import compose, container_argv, procfile
from tests.support.processes import (
    SECRET,
    free_port,
    left_running,
    refused,
    rlship,
    wait_for,
)
from transport.store import PayloadStore
from transport.zmq_sockets import free_port_pair


def test_a_wrong_password_is_named_at_once_by_every_command(start_redis, tmp_path):
    address = start_redis("--requirepass", "the-right-one")
    url = f"redis://:{SECRET}@{address}/0"
    run_id = f"pre-{uuid.uuid4().hex[:8]}"
    commands = [
        ["run", "--steps", "1", "--output-dir", str(tmp_path / "run")],
        ["orchestrate"],
        ["produce", "--groups", "1"],
        ["trainer", "--rank", "0"],
    ]
    for command in [*([*c, "--run-id", run_id] for c in commands), ["status", run_id]]:
        done = rlship(*command, "--redis-url", url)
        assert done.returncode == 2
        refused(done, "refused the credentials: a wrong password (or user)", "redis://:***@" + address)
        missing = rlship(*command, "--redis-url", f"redis://{address}/0")
        assert missing.returncode == 2
        refused(missing, f"Redis at redis://{address}/0 asks for a password and the URL gives none")
    assert left_running(run_id) == []


def test_a_password_the_server_does_not_ask_for_is_not_called_checked(redis_url, tmp_path):
    """A Redis without a password takes any (or none): doctor says the URL's is not checked."""
    host = redis_url.split("//", 1)[1]
    done = rlship("doctor", "--redis-url", f"redis://:{SECRET}@{host}", "--output-dir", str(tmp_path / "x"))
    line = next(line for line in done.stdout.splitlines() if line.startswith(("ok   redis", "warn redis")))
    assert (
        line.startswith("warn redis:")
        and "it asks for no password: the one in the URL is not checked" in line
    )
    assert SECRET not in done.stdout and not (tmp_path / "x").exists(), "doctor makes nothing"


def test_a_server_that_is_not_redis_is_named_so_by_every_command(tmp_path):
    """An HTTP server where Redis should be: every command says what answers is not Redis."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for("the HTTP server", lambda: _listening(port))
        url = f"redis://127.0.0.1:{port}/0"
        for command in (
            ["run", "--steps", "1", "--output-dir", str(tmp_path / "run")],
            ["orchestrate"],
            ["status"],
        ):
            done = rlship(*command, "--redis-url", url)
            assert done.returncode == 2
            refused(done, f"what answers at {url} is not Redis (it said b'")
    finally:
        server.kill()
        server.wait()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_database_that_is_not_a_number_or_not_there_is_refused(redis_url, tmp_path):
    base = redis_url.rsplit("/", 1)[0]
    done = rlship("run", "--steps", "1", "--output-dir", str(tmp_path), "--redis-url", f"{base}/notadb")
    refused(done, "redis_url", "'notadb'")
    for command in (["produce", "--groups", "1"], ["orchestrate"]):
        refused(rlship(*command, "--redis-url", f"{base}/99"), "database 99 does not exist")


def test_no_redis_and_no_redis_server_to_start_is_one_line(tmp_path):
    port = free_port()
    bin_dir = Path(sys.executable).parent  # python and celery, but no redis-server
    done = rlship(
        "run", "--steps", "1", "--output-dir", str(tmp_path), "--redis-url", f"redis://127.0.0.1:{port}/0",
        env={"PATH": str(bin_dir)},
    )  # fmt: skip
    assert done.returncode == 2
    refused(done, f"127.0.0.1:{port}", "redis-server is not on PATH")


def test_an_orchestrator_without_redis_gives_up_in_seconds_saying_so():
    port = free_port()
    done = rlship("orchestrate", "--redis-url", f"redis://:{SECRET}@127.0.0.1:{port}/0")
    assert done.returncode == 2
    refused(done, f"no Redis answers at redis://:***@127.0.0.1:{port}/0")


def test_an_unwritable_output_directory_is_named(redis_url, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done = rlship("run", "--steps", "1", "--output-dir", str(blocker / "run"))
    assert done.returncode == 2
    refused(done, f"output_dir='{blocker / 'run'}'", "not writable")


@pytest.mark.parametrize("rank", ["2", "-1"])
def test_a_trainer_rank_outside_the_run_is_refused(rank):
    done = rlship("trainer", "--rank", rank, "--ranks", "2", "--run-id", f"pre-{uuid.uuid4().hex[:8]}")
    assert done.returncode == 2
    refused(done, f"--rank {rank} is not a rank of this run", "ranks=2")


def test_a_zmq_port_in_use_stops_the_run_before_it_starts(redis_url, tmp_path):
    port = free_port_pair()
    run_id = f"pre-{uuid.uuid4().hex[:8]}"
    for held in (port, port + 1):
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", held))
            holder.listen()
            done = rlship("run", "--steps", "1", "--run-id", run_id, "--zmq-port", str(port),
                          "--output-dir", str(tmp_path))  # fmt: skip
        assert done.returncode == 2
        refused(done, f"127.0.0.1:{held}", "--zmq-port")
    assert left_running(run_id) == []
    assert redis.Redis.from_url(redis_url).keys(f"rlship:{run_id}:*") == []


def test_a_redis_that_evicts_keys_is_refused(start_redis, tmp_path):
    address = start_redis("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    done = rlship("run", "--steps", "1", "--output-dir", str(tmp_path), "--redis-url", f"redis://{address}/0")
    assert done.returncode == 2
    refused(done, "maxmemory-policy allkeys-lru", "--allow-eviction")


def test_default_ports_never_collide():
    """Flower's port is neither the ZMQ port nor the READY port after it, in either file."""
    zmq_port = RunSettings.model_fields["zmq_port"].default
    taken = {zmq_port, zmq_port + 1}
    flower_port = [t for t in procfile()["flower"] if t.startswith("--port=")]
    assert flower_port and int(flower_port[0].split("=")[1]) not in taken
    services = compose()["services"]
    compose_flower = [t for t in container_argv(services["flower"]["command"]) if t.startswith("--port=")]
    assert compose_flower and int(compose_flower[0].split("=")[1]) not in taken
    metrics_port = int(services["orchestrator"]["environment"]["RLSHIP_METRICS_PORT"])
    assert metrics_port not in taken | {int(compose_flower[0].split("=")[1])}


def test_a_metrics_port_in_use_stops_the_run_and_the_orchestrator(redis_url, tmp_path):
    """`rlship run` refuses before it starts anything; `rlship orchestrate` when it would serve."""
    run_id = f"pre-{uuid.uuid4().hex[:8]}"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        done = rlship("run", "--steps", "1", "--run-id", run_id, "--metrics-port", port,
                      "--output-dir", str(tmp_path), "--zmq-port", str(free_port_pair()))  # fmt: skip
        assert done.returncode == 2
        refused(done, f"metrics_port 127.0.0.1:{port} cannot be bound", "--metrics-port")
        assert left_running(run_id) == []
        assert redis.Redis.from_url(redis_url).keys(f"rlship:{run_id}:*") == []
        done = rlship("orchestrate", "--run-id", run_id, "--metrics-port", port,
                      "--output-dir", str(tmp_path))  # fmt: skip
    refused(done, f"metrics_port: cannot serve Prometheus metrics on 127.0.0.1:{port}")
    client = redis.Redis.from_url(redis_url)
    assert not client.exists(f"rlship:{run_id}:orchestrator_lease")  # the run can start again
    PayloadStore(client, run_id).expire_run(60)


def test_doctor_says_what_is_wrong_one_line_each(start_redis, workers, redis_url, tmp_path):
    shared = ["--cpu-queue", workers.cpu_queue, "--ship-queue", workers.ship_queue]
    shared += ["--output-dir", str(tmp_path)]
    healthy = rlship("doctor", *shared, "--zmq-port", str(free_port_pair()))
    assert healthy.returncode == 0, healthy.stdout
    lines = healthy.stdout.splitlines()
    assert any(line.startswith("ok   redis: ") for line in lines), lines
    assert sum(line.startswith("ok   workers: ") for line in lines) == 2, lines

    address = start_redis("--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru")
    port = free_port_pair()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port + 1))
        holder.listen()
        sick = rlship("doctor", *shared, "--zmq-port", str(port), "--redis-url", f"redis://{address}/0")
    assert sick.returncode == 1, sick.stdout
    failed = [line for line in sick.stdout.splitlines() if line.startswith("FAIL")]
    assert [line.split(":")[0] for line in failed] == ["FAIL eviction", "FAIL ports"], sick.stdout
    assert all(" -> " in line for line in failed), failed
    assert "Traceback" not in sick.stdout + sick.stderr

    # With --allow-eviction the policy is a warning, not a failure.
    allowed = rlship("doctor", *shared, "--redis-url", f"redis://{address}/0", "--allow-eviction")
    assert any(line.startswith("warn eviction: Redis evicts keys") for line in allowed.stdout.splitlines())
    assert not any(line.startswith("FAIL eviction") for line in allowed.stdout.splitlines())
