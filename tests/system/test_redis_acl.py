"""Least privilege on a shared Redis: the users `rlship acl --run R` makes, on a redis-server
of the test's own, may touch only their run's keys and run only their role's commands, and a
whole run ships with each process connected as its role's user."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import redis

from tests.support.acl import make_users, role_auth
from tests.support.processes import REPO, python_command
from transport.keys import RunKeys, run_queue
from transport.zmq_sockets import free_port_pair

ADMIN = "admin-password"


@pytest.fixture
def server(start_redis) -> tuple[str, redis.Redis]:
    address = start_redis("--requirepass", ADMIN)
    return address, redis.Redis.from_url(f"redis://:{ADMIN}@{address}/0")


def test_each_role_is_refused_another_runs_keys_and_commands_outside_its_list(server) -> None:
    address, admin = server
    run_a, run_b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    make_users(admin, run_a)
    make_users(admin, run_b)
    for variable, auth in role_auth(run_a).items():
        user, _, password = auth.partition(":")
        client = redis.Redis.from_url(f"redis://{user}:{password}@{address}/0")
        assert client.exists(RunKeys(run_a).run_marker) == 0, variable  # its own run's keys
        for other in (RunKeys(run_b).run_marker, RunKeys(run_b).rollout("r0"), run_queue(run_b, "cpu")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.exists(other)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.publish(RunKeys(run_b).policy_channel, "1")
        for outside in (("FLUSHALL",), ("CONFIG", "GET", "maxmemory"), ("KEYS", "*"), ("ACL", "LIST")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*outside)
        # A script's keys are checked too: one run's script cannot reach another's keys.
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.eval("return redis.call('GET', KEYS[1])", 1, RunKeys(run_b).run_marker)


def test_the_span_list_is_pushed_by_workers_and_relayed_by_the_orchestrator_as_their_users(server) -> None:
    """Tracing's span list (docs/observability.md, Where the spans go): a worker's spans ride
    on a task's first read and are pushed past the cap (the script trims and counts), the
    orchestrator pops, gives a batch back and counts a refused one, each as its role's user."""
    from tasks.tracing import SPANS_HELD_MAX, count_dropped_spans, dropped_spans, hold_spans, queue_spans

    address, admin = server
    run_id = f"spans-{uuid.uuid4().hex[:6]}"
    make_users(admin, run_id)
    auth = role_auth(run_id)

    def user(role: str) -> redis.Redis:
        name, _, password = auth[f"RLSHIP_REDIS_{role.upper()}_AUTH"].partition(":")
        return redis.Redis.from_url(f"redis://{name}:{password}@{address}/0")

    worker, orchestrator, keys = user("worker"), user("orchestrator"), RunKeys(run_id)
    first_read = worker.pipeline(transaction=False)
    first_read.hexists(keys.published, 0)
    at = queue_spans(first_read, run_id, [b"ridden"])
    assert dropped_spans(worker, run_id, first_read.execute()[at]) == 0
    assert hold_spans(worker, run_id, [b"%d" % n for n in range(SPANS_HELD_MAX)]) == 1
    batch = orchestrator.lpop(keys.spans, 2)
    assert batch == [b"0", b"1"]
    assert hold_spans(orchestrator, run_id, batch, oldest=True) == 0
    count_dropped_spans(orchestrator, run_id, 2)
    assert orchestrator.llen(keys.spans) == SPANS_HELD_MAX and int(orchestrator.get(keys.spans_dropped)) == 3


def test_a_producer_given_another_runs_keys_is_refused_in_one_line(server, tmp_path: Path) -> None:
    address, admin = server
    run_a, run_b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    make_users(admin, run_a)
    done = subprocess.run(
        python_command("produce", "--run-id", run_b, "--groups", "1", "--output-dir", str(tmp_path)),
        env={**os.environ, **role_auth(run_a), "REDIS_URL": f"redis://:{ADMIN}@{address}/0"},
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("rlship produce: Redis refused it (NOPERM)"), done.stderr
    assert f"pw-producer-{run_a}" not in done.stderr


@pytest.mark.timeout(240)
def test_a_run_ships_every_step_with_each_process_as_its_roles_user(server, tmp_path: Path) -> None:
    address, admin = server
    run_id = f"acl-{uuid.uuid4().hex[:6]}"
    port = free_port_pair()
    make_users(admin, run_id, "--zmq-port", str(port))
    admin.acl_log_reset()
    arguments = [
        "run", "--steps", "2", "--ranks", "2", "--batch-size", "16", "--group-size", "4", "--seq-len", "512",
        "--run-id", run_id, "--zmq-port", str(port), "--output-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    done = subprocess.run(
        python_command(*arguments),
        env={**os.environ, **role_auth(run_id), "REDIS_URL": f"redis://:{ADMIN}@{address}/0"},
        cwd=REPO, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"rlship run {run_id}: 2 steps shipped" in done.stdout
    assert "rank 0: received steps [0, 1]" in done.stdout and "rank 1: received steps [0, 1]" in done.stdout
    # Every process was its role's user: the admin's connection is the launcher's alone.
    assert admin.acl_log() == []
    users = {entry["user"] for entry in admin.client_list()}
    assert users <= {"default"}, users  # the run's processes have gone
