"""TLS and a user per role together: a run's processes reach a redis-server that listens with
TLS only (and asks each client for a certificate) as their roles' users, made by `rlship acl`
as an operator makes them; a user of one run is refused another run's keys there too."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis

from tests.support.acl import make_users, role_auth
from tests.support.processes import REPO, python_command
from tests.support.tls import make_certificates
from transport.keys import RunKeys, run_queue
from transport.zmq_sockets import free_port_pair

ADMIN = "admin-password"


@pytest.fixture
def server(start_redis, tmp_path: Path):
    """A TLS-only redis-server whose default user has a password: its URL with `credentials`
    (`USER:PASSWORD`, or the administrator's by default) and an administrator's client."""
    certificates = make_certificates(tmp_path / "certs")
    address = start_redis("--requirepass", ADMIN, tls=certificates)

    def url(credentials: str = f":{ADMIN}") -> str:
        return certificates.url(address, credentials)

    return url, redis.Redis.from_url(url())


def users_connected_while(process: subprocess.Popen, admin: redis.Redis) -> set[str]:
    """The users of the server's clients, looked at every 5 ms until `process` ends: a
    chaos run's producer writes its workload up front in well under 0.1 s of connection
    (a 0.1 s look missed it once in CI), never under 5 ms (about 30 calls over TLS)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 200
    while process.poll() is None and time.monotonic() < deadline:
        seen |= {entry["user"] for entry in admin.client_list()}
        time.sleep(0.005)
    return seen


@pytest.mark.timeout(240)
def test_a_run_over_tls_ships_every_step_with_each_process_as_its_roles_user(server, tmp_path: Path) -> None:
    url, admin = server
    run_id = f"tls-acl-{uuid.uuid4().hex[:6]}"
    port = free_port_pair()
    make_users(admin, run_id, "--zmq-port", str(port))
    admin.acl_log_reset()
    arguments = [
        "run", "--steps", "2", "--ranks", "2", "--batch-size", "16", "--group-size", "4", "--seq-len", "512",
        "--run-id", run_id, "--zmq-port", str(port), "--output-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    process = subprocess.Popen(
        python_command(*arguments),
        env={**os.environ, **role_auth(run_id), "REDIS_URL": url(), "PYTHONPATH": str(REPO)},
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = users_connected_while(process, admin)
    done = subprocess.CompletedProcess(process.args, process.returncode, *process.communicate(timeout=200))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    roles = {auth.partition(":")[0] for auth in role_auth(run_id).values()}
    assert roles <= seen, f"every role connected as its own user over TLS: {seen}"
    assert f"rlship run {run_id}: 2 steps shipped" in done.stdout
    assert "rank 0: received steps [0, 1]" in done.stdout and "rank 1: received steps [0, 1]" in done.stdout
    assert admin.hlen(RunKeys(run_id).published) == 2
    # Every process was its role's user (none was refused anything), and all have gone.
    assert admin.acl_log() == []
    assert {entry["user"] for entry in admin.client_list()} <= {"default"}


def test_a_user_of_one_run_over_tls_is_refused_another_runs_keys_in_one_line(server, tmp_path: Path) -> None:
    url, admin = server
    run_a, run_b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    make_users(admin, run_a)
    make_users(admin, run_b)
    for variable, auth in role_auth(run_a).items():
        client = redis.Redis.from_url(url(auth))
        assert client.exists(RunKeys(run_a).run_marker) == 0, variable  # over TLS, its own run's keys
        for other in (RunKeys(run_b).run_marker, run_queue(run_b, "cpu")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.exists(other)
    done = subprocess.run(
        python_command("produce", "--run-id", run_b, "--groups", "1", "--output-dir", str(tmp_path)),
        env={**os.environ, **role_auth(run_a), "REDIS_URL": url(), "PYTHONPATH": str(REPO)},
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("rlship produce: Redis refused it (NOPERM)"), done.stderr
    assert f"pw-producer-{run_a}" not in done.stderr and ADMIN not in done.stderr


@pytest.mark.timeout(300)
def test_chaos_over_tls_with_the_roles_users_delivers_every_step_once_in_order(server, tmp_path) -> None:
    """`rlship chaos` given a TLS administrator's REDIS_URL and every role's USER:PASSWORD:
    it makes each of its two runs' users, its processes connect as them over TLS while they
    are killed, and the steps arrive as in the fault-free run; the users go with the runs."""
    url, admin = server
    auth = role_auth("chaos")
    report = tmp_path / "chaos.json"
    arguments = [
        "chaos", "--steps", "10", "--kill-every", "0.2", "--batch-size", "16", "--seq-len", "256",
        "--timeout", "100", "--json", str(report),
    ]  # fmt: skip
    process = subprocess.Popen(
        python_command(*arguments),
        env={**os.environ, **auth, "REDIS_URL": url(), "PYTHONPATH": str(REPO)},
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = users_connected_while(process, admin)
    done = subprocess.CompletedProcess(process.args, process.returncode, *process.communicate(timeout=250))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {value.partition(":")[0] for value in auth.values()} <= seen, seen
    result = json.loads(report.read_text())
    assert result["goal_met"] and result["steps_delivered_per_rank"] == {"0": 10, "1": 10}
    assert result["duplicates_delivered"] == result["out_of_order"] == result["payload_mismatches"] == 0
    assert result["records_published"] == 10 and result["keys_left"] == 0
    assert {"orchestrator", "ship-worker"} <= set(result["kills_by_target"])
    assert admin.acl_log() == [], "no process was refused anything"
    assert admin.acl_users() == ["default"], "the runs' users are deleted with them"
