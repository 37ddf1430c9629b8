"""The run's Redis primary dies, and Sentinel promotes its replica: nothing is lost.

Real servers on loopback ports (a primary, a replica and three Sentinels, each in its own
directory: `orchestrator.commands.sentinel_cluster`), real Celery workers, the orchestrator
as its own process and trainer ranks that receive as prime-rl's stock ones do (they never
talk to Redis, check nothing and replay nothing). The primary is SIGKILLed five times while
steps are cut, encoded, sent and published; each time the killed server is started again
as a replica of the new primary, as a supervisor would. The oracles are the ranks' own
records of what they received, the run's checksums of what it encoded, the records read
back from the last primary, and what this test's producer was told was written.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis

from orchestrator.commands.processes import delete_run_keys
from orchestrator.commands.sentinel_cluster import ClusterTLS, LocalSentinelCluster
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings
from tests.support.acl import acl_lines, role_auth
from tests.support.factories import group
from tests.support.processes import REPO, python_command, refused, running_workers
from tests.support.shiprun import deterministic_run, metrics_lines, start_orchestrator
from tests.support.stock_peers import await_every_step, read_record, start_stock_ranks
from tests.support.tls import make_certificates
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.zmq_sockets import free_port_pair

pytestmark = pytest.mark.timeout(600)

STEPS, KILLS = 30, 5
# 16 steps' worth written up front; the other 14 by a producer while the primary dies, so the
# run's last cut takes the last of them and its record must account for every one.
LIVE_GROUPS = 28


def produce_during_failovers(settings, acknowledged: list[str], failed: list[BaseException]) -> None:
    """A producer of the run on its own Sentinel client: each group it is told was written
    is recorded; it must then be in the run's accounting, whatever primary died."""
    producer = RolloutProducer.for_run(connect_redis(settings.redis_url), settings, admitted=False)
    try:
        for index in range(LIVE_GROUPS):
            rollouts = group(f"live{index}", [1.0, 0.0, 0.0, 1.0], num_output_tokens=12 + index, env="math")
            producer.produce(rollouts)
            acknowledged += [record.rollout_id for record, _ in rollouts]
            time.sleep(0.5)
    except BaseException as exc:
        failed.append(exc)


def wait_published(
    client: redis.Redis, key: str, count: int, orchestrator, log: Path, timeout: float
) -> float:
    deadline = time.monotonic() + timeout
    while client.hlen(key) < count:
        assert orchestrator.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"step {count} not published within {timeout:.0f} s"
        time.sleep(0.02)
    return time.monotonic()


@pytest.mark.parametrize("transport", ["zmq", "fs"])
def test_five_primary_kills_lose_nothing(transport, run_id, tmp_path):
    with LocalSentinelCluster(tmp_path / "redis") as cluster:
        url = cluster.url
        client = connect_redis(url)
        (tmp_path / "worker-logs").mkdir()
        with running_workers(url, tmp_path / "worker-logs") as workers:
            settings = deterministic_run(client, run_id, url, workers, tmp_path, 15).with_changes(
                steps=STEPS, trainers="external", stall_seconds=3.0, transport=transport
            )
            assert settings.redis_wait_replicas == 1, "with Sentinels a write waits for a replica"
            records, peers = start_stock_ranks(
                settings, [STEPS if transport == "fs" else None] * settings.ranks
            )
            log = tmp_path / "orchestrator.log"
            orchestrator = start_orchestrator(settings, log)
            acknowledged: list[str] = []
            failed: list[BaseException] = []
            producer = threading.Thread(
                target=produce_during_failovers, args=(settings, acknowledged, failed)
            )
            published = RunKeys(run_id).published
            stalls, promotions = [], []
            try:
                wait_published(client, published, 2, orchestrator, log, 120)
                producer.start()
                for threshold in range(4, 4 + 5 * KILLS, 5):
                    wait_published(client, published, threshold, orchestrator, log, 120)
                    before = client.hlen(published)
                    killed = time.monotonic()
                    promotions.append(cluster.fail_over())
                    stalls.append(
                        wait_published(client, published, before + 1, orchestrator, log, 120) - killed
                    )
                producer.join(120)
                assert orchestrator.wait(240) == 0, log.read_text()[-3000:]
                await_every_step(transport, peers, records, STEPS)
            finally:
                for peer in peers:
                    peer.kill()
                if orchestrator.poll() is None:
                    orchestrator.kill()
            assert not failed, f"the producer failed: {failed}"
            steps = list(settings.step_numbers)
            keys = RunKeys(run_id)
            encoded = {k.decode(): v.decode() for k, v in client.hgetall(keys.sent_checksums).items()}
            interrupted = {k.decode() for k in client.hkeys(keys.interrupted_sends)}
            for rank, record in enumerate(records):
                got = read_record(record)
                received = [entry["step"] if transport == "fs" else entry["topic_step"] for entry in got]
                # A send redone after an interrupted one may reach a stock rank twice, right
                # after itself, and is counted (docs/reliability.md); any other duplicate is a bug.
                again = [b for a, b in itertools.pairwise(received) if a == b]
                assert all(f"{step}:{rank}" in interrupted for step in again), (rank, received, interrupted)
                assert [s for i, s in enumerate(received) if i == 0 or received[i - 1] != s] == steps, (
                    received
                )
                for step, entry in zip(received, got, strict=True):
                    assert entry["xxh3_128"] == encoded[f"{step}:{rank}"], (
                        f"rank {rank} step {step} as encoded"
                    )
            lines = metrics_lines(settings)
            assert [int(line["step"]) for line in lines] == steps, "one record per step, in order"
            stream = [int(fields[b"step"]) for _, fields in client.xrange(keys.metrics_stream)]
            assert stream == steps, "one record per step on the last primary too"
            for line in lines:
                settled = sum(
                    line[f"accounting/{term}"]
                    for term in ("cut", "pending", "in_open_groups", "rejected", "discarded")
                )
                assert line["accounting/arrived"] == settled, f"step {line['step']}: accounting balanced"
            assert len(acknowledged) == LIVE_GROUPS * 4, "the producer was told every group was written"
            produced = int(client.get(keys.produced))
            assert produced == 16 * 8 + len(acknowledged), (
                "every acknowledged rollout is on the last primary, once"
            )
            assert lines[-1]["accounting/arrived"] == produced, "and reached the run's accounting"
            said = log.read_text()
            assert said.count("Redis primary unreachable since") >= KILLS, "each failover is said in the log"
            assert said.count("Redis primary is 127.0.0.1:") >= KILLS, "and which primary answered"
            promoted, stalled = [round(p, 1) for p in promotions], [round(s, 1) for s in stalls]
            print(
                f"{transport}: primary killed {KILLS} times; promoted after {promoted} s; "
                f"kill to next step published {stalled} s; resent: {sorted(interrupted)}"
            )
        delete_run_keys(settings)


def test_a_user_run_on_sentinels_shows_the_topology_and_refuses_too_few_replicas(tmp_path):
    """`rlship run`, `doctor` and `status` started as a user starts them, REDIS_URL naming the
    Sentinels: the run ships; doctor and status show the primary the Sentinels name and its
    replica; a run asking for more replicas than are online stops at once, in one line."""
    with LocalSentinelCluster(tmp_path / "redis") as cluster:
        env = {**os.environ, "REDIS_URL": cluster.url}
        primary = f"primary 127.0.0.1:{cluster.primary_port()}"

        def rlship(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                python_command(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=180
            )

        doctor = rlship("doctor")
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert f"ok   replicas: {primary}" in doctor.stdout and "(online" in doctor.stdout
        assert "Sentinels answering 3 of 3; writes wait for 1 replica(s)" in doctor.stdout
        done = rlship(
            "run", "--steps", "2", "--redis-wait-replicas", "2", "--output-dir", str(tmp_path / "r2")
        )
        refused(done, "redis_wait_replicas=2", "1 replica(s) are online")
        run = rlship("run", "--steps", "3", "--run-id", "on-sentinels", "--output-dir", str(tmp_path / "run"))
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "3 steps shipped" in run.stdout
        status = rlship("status", "on-sentinels")
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith(f"redis: {primary} (master_name 'rlship'); replicas: 127.0.0.1:")
        delete_run_keys(RunSettings(redis_url=cluster.url, run_id="on-sentinels"))


def test_a_run_over_tls_sentinels_as_the_roles_users_rides_out_two_primary_kills(tmp_path):
    """`rlship run` on a primary, a replica and three Sentinels that all listen with TLS only
    (and ask each client for a certificate), each process connected as its role's user, the
    users given to every server (ACL users are not replicated) and again to the killed one
    when it is started again; the primary is SIGKILLed twice mid-run: every step reaches
    every rank once, and no process was refused anything."""
    certificates = make_certificates(tmp_path / "certs")
    tls = ClusterTLS(certificates.ca, certificates.server_cert, certificates.server_key)
    run_id, port, steps = f"tls-failover-{uuid.uuid4().hex[:6]}", free_port_pair(), 12
    with LocalSentinelCluster(tmp_path / "redis", tls=tls) as cluster:
        cluster.give_acl(acl_lines(run_id, "--zmq-port", str(port)))
        client = connect_redis(cluster.url)
        arguments = [
            "run", "--steps", str(steps), "--ranks", "2", "--batch-size", "16", "--group-size", "4",
            "--seq-len", "256", "--run-id", run_id, "--zmq-port", str(port),
            "--output-dir", str(tmp_path / "run"),
        ]  # fmt: skip
        process = subprocess.Popen(
            python_command(*arguments),
            env={**os.environ, **role_auth(run_id), "REDIS_URL": cluster.url, "PYTHONPATH": str(REPO)},
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        users: set[str] = set()
        killed_after: list[int] = []  # steps published at each kill
        deadline = time.monotonic() + 150
        while process.poll() is None and time.monotonic() < deadline:
            for server in cluster.clients():
                with contextlib.suppress(redis.RedisError):
                    users |= {entry["user"] for entry in server.client_list()}
            published = client.hlen(RunKeys(run_id).published)
            # The second kill promotes the server killed first: its users are those given
            # to it again when it was started again. It comes one step after the first
            # failover ended (the run goes on while the killed server is started again).
            if len(killed_after) < 2 and published >= (killed_after[-1] + 1 if killed_after else 2):
                killed_after.append(published)
                cluster.fail_over()
            time.sleep(0.1)
        stdout, stderr = process.communicate(timeout=30)
        assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert len(killed_after) == 2 and killed_after[-1] < steps, f"killed mid-run: {killed_after}"
        shipped = str(list(range(steps)))
        assert f"rank 0: received steps {shipped}" in stdout and f"rank 1: received steps {shipped}" in stdout
        assert client.hlen(RunKeys(run_id).published) == steps, "every record on the last primary"
        assert {auth.partition(":")[0] for auth in role_auth(run_id).values()} <= users, users
        said = (tmp_path / "run" / "logs" / "orchestrator.log").read_text()
        assert "Redis primary is 127.0.0.1:" in said, "the orchestrator reached the new primary over TLS"
        for server in cluster.clients():
            assert server.acl_log() == [], "no process was refused anything, before the kill or after"
        delete_run_keys(RunSettings(redis_url=cluster.url, run_id=run_id))
