"""A run's Redis over TLS: every client (orchestrator, producer, workers' broker and result
backend, trainer ranks, the commands) given the CA, certificate and key of a `rediss://` URL,
to a redis-server that listens with TLS only and asks each client for a certificate."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
import redis

from tests.support.processes import REPO, python_command
from tests.support.tls import make_certificates
from transport.connection import celery_redis_options, connect_redis
from transport.keys import RunKeys
from transport.zmq_sockets import free_port_pair


@pytest.mark.timeout(240)
def test_rlship_run_over_tls_ships_every_step(start_redis, tmp_path: Path) -> None:
    certificates = make_certificates(tmp_path / "certs")
    address = start_redis(tls=certificates)
    url = certificates.url(address)
    run_id = f"tls-{uuid.uuid4().hex[:8]}"
    arguments = [
        "run", "--steps", "2", "--ranks", "2", "--batch-size", "16", "--group-size", "4", "--seq-len", "512",
        "--run-id", run_id, "--zmq-port", str(free_port_pair()), "--output-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    done = subprocess.run(
        python_command(*arguments),
        env={**os.environ, "REDIS_URL": url, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"rlship run {run_id}: 2 steps shipped" in done.stdout
    assert "rank 0: received steps [0, 1]" in done.stdout and "rank 1: received steps [0, 1]" in done.stdout
    assert connect_redis(url).hlen(RunKeys(run_id).published) == 2
    # Celery is given the CA, certificate and key itself: kombu would take a bare rediss://
    # as TLS that checks no certificate.
    options = celery_redis_options(url)
    assert options["broker_url"] == f"rediss://{address}/0"
    assert options["broker_use_ssl"]["ssl_ca_certs"] == str(certificates.ca)
    assert options["redis_backend_use_ssl"] == options["broker_use_ssl"]


def test_a_client_without_the_servers_ca_or_tls_is_refused_in_one_line(start_redis, tmp_path: Path) -> None:
    certificates = make_certificates(tmp_path / "certs")
    address = start_redis(tls=certificates)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(f"redis://{address}", socket_connect_timeout=2).ping()
    other = make_certificates(tmp_path / "other")
    wrong_ca = certificates.url(address).replace(
        str(certificates.ca).replace("/", "%2F"), str(other.ca).replace("/", "%2F")
    )
    done = subprocess.run(
        python_command("status", "--redis-url", wrong_ca),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "certificate verify failed" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2, done.stderr

    missing = certificates.url(address).replace("client.key", "nowhere.key")
    done = subprocess.run(
        python_command("status", "--redis-url", missing), cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "ssl_keyfile: there is no file" in done.stderr, done.stderr
