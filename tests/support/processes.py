"""Test helpers for processes: the repository, rlship commands, Celery workers on this
session's own queues, a free port, waiting for a condition, and the prerequisites a test
needs (`require`). Fixtures that use them are in tests/conftest.py."""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import psutil
import pytest

from orchestrator.commands.processes import celery_worker_command, delete_queues
from orchestrator.worker_queries import answering_workers
from transport.connection import connect_redis

REPO = Path(__file__).resolve().parents[2]
COMMAND_DEADLINE_SECONDS = 30
SECRET = "hunter2-not-this-one"  # a password no output may show


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


def python_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.commands.cli", *args]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(what: str, condition, timeout: float = COMMAND_DEADLINE_SECONDS):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def signal_when(
    process: subprocess.Popen, what: str, condition, signum: int, timeout: float = 60, wait: float = 90
) -> tuple[str, str]:
    """Once `condition` holds (waited for up to `wait` s), send `process` `signum` and return
    what it printed until it exited (within `timeout` s); a process still running after
    that is killed, and the test fails."""
    try:
        wait_for(what, condition, wait)
        process.send_signal(signum)
        return process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def rlship(
    *args: str, env: dict[str, str] | None = None, timeout: float = COMMAND_DEADLINE_SECONDS
) -> subprocess.CompletedProcess:
    """The command's result; one still running after `timeout` seconds fails the test, and it
    and everything it started are ended by PID."""
    process = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.commands.cli", *args],
        env={**os.environ, **(env or {})},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]
        for member in tree:
            member.kill()
        psutil.wait_procs(tree, timeout=10)
        pytest.fail(f"rlship {' '.join(args)} still running after {timeout} s")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def refused(done: subprocess.CompletedProcess, *names: str) -> str:
    """The command failed in at most two lines naming each of `names`, without a traceback
    or the secret; nothing it started is still running."""
    output = (done.stdout + done.stderr).strip()
    assert done.returncode != 0, output
    assert "Traceback" not in output and SECRET not in output, output
    assert 1 <= len(output.splitlines()) <= 2, output
    for name in names:
        assert name in output, (name, output)
    return output


def left_running(marker: str) -> list[str]:
    return [
        " ".join(p.info["cmdline"] or [])
        for p in psutil.process_iter(["cmdline"])
        if any(marker in part for part in p.info["cmdline"] or [])
    ]


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
        delete_queues(connect_redis(self.redis_url), (self.cpu_queue, self.ship_queue))


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
