"""Child processes of a local run: started with their own settings in the environment,
stopped by PID (SIGTERM, then SIGKILL after a grace period), never by name.

Each child has a process group of its own, so a signal to the run's group (Ctrl-C, a
supervisor's SIGTERM) reaches `rlship run` alone, which stops its children in order; and
each gets SIGTERM from the kernel if `rlship run` dies without doing so (SIGKILL)."""

from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from orchestrator.settings import RunSettings
from orchestrator.worker_queries import answering_workers
from tasks.logs import mask_secrets
from transport.connection import RedisAddress, connect_redis
from transport.keys import RunKeys, queue_traces

# Where children start: `python -m orchestrator.commands.cli` finds the packages here.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
# kombu's sorted set of when each expiring queue's binding table may be swept.
BINDING_DEADLINES = "_kombu.binding_deadlines"
PR_SET_PDEATHSIG = 1


def stop_with_parent(parent: int) -> None:
    """In a child before it runs its command: SIGTERM when its parent dies (Linux), and at
    once if the parent (`parent`, its pid) died before this call."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def rlship_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.commands.cli", *args]


def celery_worker_command(
    queue: str, concurrency: int, name: str, max_memory_mib: int | None = None
) -> list[str]:
    """A worker command; with `max_memory_mib`, a pool process whose memory has grown past
    it is replaced after its task (the ship worker keeps its one process: it owns sockets)."""
    recycle = [] if max_memory_mib is None else ["--max-memory-per-child", str(max_memory_mib * 1024)]
    return [
        sys.executable, "-m", "celery", "-A", "tasks", "worker",
        "-Q", queue, "-c", str(concurrency), "--prefetch-multiplier", "1", "-n", name,
        "-E", "--without-gossip", "--without-mingle", "--loglevel", "WARNING", *recycle,
    ]  # fmt: skip


def worker_commands(settings: RunSettings) -> dict[str, list[str]]:
    """The two kinds of worker: compute stages, and the one process that owns the sockets."""
    return {
        "cpu-worker": celery_worker_command(
            settings.cpu_queue,
            settings.cpu_workers,
            f"cpu-{settings.run_id}@%h",
            settings.cpu_worker_max_memory_mib,
        ),
        "ship-worker": celery_worker_command(settings.ship_queue, 1, f"ship-{settings.run_id}@%h"),
    }


@dataclass
class ProcessGroup:
    """Processes this run started, in start order; stopped in reverse order."""

    env: Mapping[str, str]
    log_dir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)

    def start(self, name: str, command: Sequence[str], *, capture: bool = True) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.commands[name] = list(command)
        out = open(self.log_dir / f"{name}.log", "ab") if capture else None  # noqa: SIM115
        process = subprocess.Popen(
            list(command),
            env={**os.environ, **self.env},
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            cwd=SOURCE_ROOT,
            process_group=0,
            preexec_fn=functools.partial(stop_with_parent, os.getpid()),
        )
        self.processes[name] = process
        return process

    def stop(self, name: str, grace: float = 10.0) -> int | None:
        process = self.processes.pop(name, None)
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def stop_all(self, grace: float = 10.0) -> None:
        for name in reversed(list(self.processes)):
            self.stop(name, grace)

    def restart(self, name: str) -> subprocess.Popen:
        """Start an exited child again with the same command (its log is appended to)."""
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self.processes.pop(name, None)
        return self.start(name, self.commands[name])

    def failed(self) -> dict[str, int]:
        """Processes that exited while they should still be running."""
        return {n: p.returncode for n, p in self.processes.items() if p.poll() not in (None, 0)}


def redis_answers(url: str) -> bool:
    try:
        return bool(connect_redis(url, ride_out_outages=False, socket_connect_timeout=1).ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


def ensure_redis(url: str, group: ProcessGroup, data_dir: Path) -> bool:
    """Use the Redis at `url`, or start one if none answers (True). Its append-only file (in
    `data_dir`) is synced on every write, so a killed and restarted Redis loses nothing it
    acknowledged: the ship path's marks and the records stay true."""
    if redis_answers(url):
        return False
    address = RedisAddress.parse(url)
    if address.is_sentinel or address.uses_tls:
        where = "no Redis answers"
        if address.is_sentinel:
            where = "no Sentinel there names a primary that answers"
        raise SystemExit(
            f"rlship: redis_url={mask_secrets(url)!r}: {where} "
            "(rlship starts a Redis of its own only for a plain redis:// URL)"
        )
    port = redis.connection.parse_url(url).get("port", 6379)
    data_dir.mkdir(parents=True, exist_ok=True)
    group.start(
        "redis",
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            str(data_dir.resolve()),
            "--maxmemory-policy",
            "noeviction",
        ],
    )
    deadline = time.monotonic() + 10
    while not redis_answers(url):
        if time.monotonic() > deadline:
            raise SystemExit(
                f"rlship: redis_url={mask_secrets(url)!r}: no Redis answers, and the one started did not "
                "come up "
                f"(its log: {group.log_dir / 'redis.log'})"
            )
        time.sleep(0.1)
    return True


def wait_for_workers(settings: RunSettings, group: ProcessGroup, timeout: float = 60.0) -> None:
    """Until both workers of this placement answer a ping (they consume their queues)."""
    expected = {f"cpu-{settings.run_id}@", f"ship-{settings.run_id}@"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if group.failed():
            raise RuntimeError(f"workers exited: {group.failed()}; logs in {group.log_dir}")
        names = answering_workers(settings.redis_url)
        if all(any(n.startswith(prefix) for n in names) for prefix in expected):
            return
    raise RuntimeError(f"workers did not answer a ping within {timeout:.0f} s; logs in {group.log_dir}")


def delete_queues(client: redis.Redis, queues: Collection[str]) -> None:
    """Every trace of one-off Celery queues: the lists, kombu's bindings of them (and the
    deadline of an expiring one's), and the messages a killed worker left unacknowledged
    for them (a live worker would restore those, making the queue again, with no expiry)."""
    owned = set(queues)
    if not owned:
        return
    client.unlink(*(key for queue in owned for key in queue_traces(queue)))
    client.zrem(BINDING_DEADLINES, *owned)
    # kombu keeps each unacknowledged message as JSON [message, exchange, routing key].
    left = [tag for tag, entry in client.hscan_iter("unacked") if json.loads(entry)[-1] in owned]
    if left:
        client.pipeline().hdel("unacked", *left).zrem("unacked_index", *left).execute()


def delete_run_keys(settings: RunSettings) -> None:
    """Every key of the placement's run, and the traces of its one-off queues."""
    client = connect_redis(settings.redis_url)
    keys = list(client.scan_iter(match=RunKeys(settings.run_id).prefix + "*", count=1000))
    for start in range(0, len(keys), 1000):
        client.unlink(*keys[start : start + 1000])
    delete_queues(client, (settings.cpu_queue, settings.ship_queue))
