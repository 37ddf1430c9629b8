"""Shared fixtures: the real Redis, real Celery worker processes, throwaway Redis servers.
The helpers behind them are in tests/support/.

Workers listen on queues unique to this test session, so a session never takes (or
gives) tasks of another session or of a local run on the same Redis.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import settings

from orchestrator.commands.processes import delete_queues, redis_answers
from tasks.app import DEFAULT_REDIS_URL
from tests.support.fuzz import CI
from tests.support.processes import SESSION_QUEUES, Workers, free_port, running_workers
from tests.support.tls import Certificates
from transport.keys import RUN_QUEUE_KINDS, run_queue
from transport.store import PayloadStore

UNEXPIRING_BEFORE = pytest.StashKey[set[str]]()

# CI draws the same examples every run (a failure there reproduces anywhere), times none of
# them out and keeps no example database; each test still sets how many examples it runs.
settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True)
if CI:
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    if not redis_answers(url):
        pytest.fail(f"no Redis answers at REDIS_URL={url!r}; start one (see README)")
    return url


@pytest.fixture()
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture()
def run_id() -> Iterator[str]:
    """A fresh run id; whatever keys of it the test leaves get an expiry (an hour), and its
    own queues go (a test that drives an orchestrator without workers leaves its tasks)."""
    run = f"test-{uuid.uuid4().hex[:10]}"
    yield run
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    if redis_answers(url):
        client = redis.Redis.from_url(url)
        PayloadStore(client, run).expire_run(3600)
        delete_queues(client, [run_queue(run, kind) for kind in RUN_QUEUE_KINDS])


@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator:
    """redis-server processes on free ports with the given options, stopped by PID; with
    `tls` (`tests.support.tls`), listening with TLS only."""
    started: list[subprocess.Popen] = []

    def start(*options: str, tls: Certificates | None = None) -> str:
        port = free_port()
        listen = tls.server_options(port) if tls else ["--port", str(port)]
        process = subprocess.Popen(
            ["redis-server", *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path), *options],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        started.append(process)
        address = f"127.0.0.1:{port}"
        client = redis.Redis.from_url(
            tls.url(address) if tls else f"redis://{address}", socket_connect_timeout=1
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis.AuthenticationError:
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        return address

    yield start
    for process in started:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="session")
def workers(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    os.environ["REDIS_URL"] = redis_url
    with running_workers(redis_url, tmp_path_factory.mktemp("worker-logs")) as pool:
        yield pool


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    """Processes a test starts; whatever is still running at teardown is terminated."""
    started: list[Any] = []
    yield started
    for proc in started:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def pytest_sessionfinish(session: pytest.Session) -> None:
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    if SESSION_QUEUES and redis_answers(url):
        delete_queues(redis.Redis.from_url(url), SESSION_QUEUES)


def unexpiring_keys(client: redis.Redis) -> set[str]:
    """Every key of any run (`rlship:*`) without an expiry."""
    return {key.decode() for key in client.scan_iter(match="rlship:*", count=1000) if client.ttl(key) == -1}


def pytest_sessionstart(session: pytest.Session) -> None:
    """What Redis holds without an expiry before the tests: the session answers only for
    what it adds (a developer's own run may share the server)."""
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    session.config.stash[UNEXPIRING_BEFORE] = (
        unexpiring_keys(redis.Redis.from_url(url)) if redis_answers(url) else set()
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """List the run keys the session left in Redis without an expiry, whatever the run's id
    (tests start runs named `test-*`, `cli-*`, `absent-*`, ...): a test must delete what it
    writes, or leave it to expire."""
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    if not redis_answers(url):
        return
    before = terminalreporter.config.stash.get(UNEXPIRING_BEFORE, set())
    left = sorted(unexpiring_keys(redis.Redis.from_url(url)) - before)
    if left:
        terminalreporter.section("rlship keys left without an expiry")
        terminalreporter.line(f"{len(left)} keys of the session's runs would stay in Redis forever, e.g.:")
        for key in left[:20]:
            terminalreporter.line(f"  {key}")
