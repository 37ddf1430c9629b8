"""Shared fixtures: the real Redis, real Celery worker processes, helpers to run steps.

Workers listen on queues unique to this test session, so a session never takes (or
gives) tasks of another session or of a local run on the same Redis.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from orchestrator.processes import answering_workers, celery_worker_command, delete_queues, redis_answers
from tasks.app import DEFAULT_REDIS_URL
from transport.store import PayloadStore

REPO = Path(__file__).resolve().parent.parent

SESSION_QUEUES: set[str] = set()


def session_queue(name: str) -> str:
    """A one-off Celery queue of this test session: its traces (the list, kombu's bindings,
    messages a killed worker left unacknowledged) are deleted when the session ends, after
    every process that could re-create them has stopped."""
    SESSION_QUEUES.add(name)
    return name


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(prerequisite: str, missing: str | None) -> None:
    """The one place a test's prerequisite (root, `ip netns`, a browser, an optional
    package) is enforced: when `missing` says why it is absent, the test fails under
    CI=true, where everything must run, and skips elsewhere; both name it and say why."""
    if missing is None:
        return
    message = f"needs {prerequisite}: {missing}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: a prerequisite must not be missing in CI)", pytrace=False)
    pytest.skip(message)


def require_module(name: str) -> ModuleType:
    """An optional package, imported, or `require`'s verdict naming it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require(f"the Python package {name!r}", f"{exc} (pip install -e '.[test]')")
        raise


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
    """A fresh run id; whatever keys of it the test leaves get an expiry (an hour)."""
    run = f"test-{uuid.uuid4().hex[:10]}"
    yield run
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    if redis_answers(url):
        PayloadStore(redis.Redis.from_url(url), run).expire_run(3600)


class Workers:
    """A cpu worker and a ship worker, as subprocesses, on this session's queues."""

    def __init__(
        self,
        redis_url: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        max_memory_mib: int | None = None,
    ) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.max_memory_mib = max_memory_mib
        self.cpu_queue = session_queue(f"cpu-{suffix}")
        self.ship_queue = session_queue(f"ship-{suffix}")
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.env = env or {}
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, kind: str) -> subprocess.Popen:
        queue, concurrency = (self.cpu_queue, 2) if kind == "cpu" else (self.ship_queue, 1)
        name = f"{kind}-{queue}-{len(self.processes)}@%h"
        log = open(self.log_dir / f"{kind}-{len(self.processes)}.log", "ab")  # noqa: SIM115
        process = subprocess.Popen(
            celery_worker_command(queue, concurrency, name, self.max_memory_mib if kind == "cpu" else None),
            env={**os.environ, "REDIS_URL": self.redis_url, "PYTHONPATH": str(REPO), **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        self.processes[kind] = process
        return process

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until each worker answers a ping (it has connected and consumes its queue)."""
        deadline = time.monotonic() + timeout
        expected = len(self.processes)
        while time.monotonic() < deadline:
            for kind, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{kind} worker exited with {process.returncode}; see {self.log_dir}")
            names = answering_workers(self.redis_url)
            if sum(any(q in n for n in names) for q in (self.cpu_queue, self.ship_queue)) >= expected:
                return
        raise RuntimeError(f"workers did not answer a ping within {timeout} s; see {self.log_dir}")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        # A stopped worker puts back what it held (a retry waiting for its countdown): the
        # session's queues are its own, so they go with it.
        delete_queues(redis.Redis.from_url(self.redis_url), (self.cpu_queue, self.ship_queue))


@contextlib.contextmanager
def running_workers(
    redis_url: str, log_dir: Path, env: dict[str, str] | None = None, max_memory_mib: int | None = None
) -> Iterator[Workers]:
    """A cpu and a ship worker, answering pings, stopped by PID on the way out."""
    pool = Workers(redis_url, log_dir, env, max_memory_mib)
    pool.start("cpu")
    pool.start("ship")
    try:
        pool.wait_ready()
        yield pool
    finally:
        pool.stop()


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


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """List the keys of test runs (`rlship:test-*`) left in Redis without an expiry: a test
    must delete what it writes, or leave it to expire."""
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    if not redis_answers(url):
        return
    client = redis.Redis.from_url(url)
    keys = client.scan_iter(match="rlship:test-*", count=1000)
    left = sorted(key.decode() for key in keys if client.ttl(key) == -1)
    if left:
        terminalreporter.section("rlship keys left without an expiry")
        terminalreporter.line(f"{len(left)} keys of test runs would stay in Redis forever, e.g.:")
        for key in left[:20]:
            terminalreporter.line(f"  {key}")


def python_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli", *args]
