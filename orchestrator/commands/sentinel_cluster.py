"""A Redis primary, its replicas and three Sentinels on loopback ports, for `rlship chaos
--kill-redis-primary`, `rlship bench loop --replica` and the failover tests: each server in
its own directory, none keeping anything on disk, all ended by PID.

`fail_over` is the fault: SIGKILL the current primary, wait until the Sentinels have
promoted a replica, then start the killed server again as a replica of the new primary (as
an operator's supervisor would), and say how long the Sentinels took.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from transport.zmq_sockets import free_port_pair

MASTER_NAME = "rlship"
SENTINELS = 3
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 2000  # a Sentinel tries the same master's failover again after twice this
START_SECONDS = 30.0
FAILOVER_SECONDS = 30.0


class ClusterFailed(RuntimeError):
    """The servers did not come up, or the Sentinels did not fail over, in time."""


@dataclass
class _Server:
    port: int
    directory: Path
    process: subprocess.Popen | None = None


@dataclass
class LocalSentinelCluster:
    """A primary with `replicas` replicas, watched by three Sentinels (quorum 2)."""

    root: Path
    replicas: int = 1
    servers: list[_Server] = field(default_factory=list)
    sentinels: list[_Server] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The run's `redis_url`: kombu's Sentinel form, the master's name in the query."""
        chunks = ";".join(f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels)
        return f"{chunks}/0?master_name={MASTER_NAME}"

    def start(self) -> LocalSentinelCluster:
        for index in range(1 + self.replicas):
            server = _Server(free_port_pair(), self.root / f"redis-{index}")
            server.directory.mkdir(parents=True, exist_ok=True)
            self.servers.append(server)
            replica_of = None if index == 0 else self.servers[0].port
            self._start_server(server, replica_of)
        primary = self.servers[0].port
        for index in range(SENTINELS):
            sentinel = _Server(free_port_pair(), self.root / f"sentinel-{index}")
            sentinel.directory.mkdir(parents=True, exist_ok=True)
            config = sentinel.directory / "sentinel.conf"
            config.write_text(
                f"port {sentinel.port}\nbind 127.0.0.1\ndir {sentinel.directory}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            sentinel.process = self._popen(["redis-server", str(config), "--sentinel"], sentinel)
            self.sentinels.append(sentinel)
        self._wait(
            self._ready, START_SECONDS, "the primary, its replicas and three Sentinels to see each other"
        )
        self._wait_replicas_in_sync("the replicas to catch up")
        return self

    def primary_port(self) -> int:
        """The primary's port: the one most Sentinels name, if it says it is the primary."""
        named: list[int] = []
        for sentinel in self.sentinels:
            try:
                host_port = _client(sentinel.port).sentinel_get_master_addr_by_name(MASTER_NAME)
            except redis.RedisError:
                continue
            if host_port:
                named.append(int(host_port[1]))
        for port in sorted(set(named), key=named.count, reverse=True):
            role = _client(port).info("replication").get("role")
            if 2 * named.count(port) > SENTINELS and role == "master":
                return port
        raise ClusterFailed(f"no primary named by most Sentinels (they name {named})")

    def _all_sentinels_name(self, port: int) -> bool:
        """Whether every Sentinel names `port` the primary: a Sentinel that lags would name the
        killed server, once started again, to a client that asks it first."""
        named = [_client(s.port).sentinel_get_master_addr_by_name(MASTER_NAME) for s in self.sentinels]
        return all(host_port and int(host_port[1]) == port for host_port in named)

    def fail_over(self) -> float:
        """SIGKILL the primary, wait for the Sentinels to promote a replica, start the killed
        server again as the new primary's replica and wait until it is in sync. Returns the
        seconds from the kill to the promotion."""
        old = self.primary_port()
        server = next(s for s in self.servers if s.port == old)
        assert server.process is not None
        killed = time.monotonic()
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        self._wait(
            lambda: self._promoted_other_than(old), FAILOVER_SECONDS, f"a replica promoted after {old}"
        )
        promoted = time.monotonic() - killed
        primary = self.primary_port()
        self._wait(
            lambda: self._all_sentinels_name(primary), FAILOVER_SECONDS, f"every Sentinel to name {primary}"
        )
        self._start_server(server, primary)
        self._wait_replicas_in_sync(f"{old} to rejoin as a replica")
        return promoted

    def stop(self) -> None:
        for server in [*self.sentinels, *self.servers]:
            if server.process is not None and server.process.poll() is None:
                server.process.terminate()
                try:
                    server.process.wait(10)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait()

    def __enter__(self) -> LocalSentinelCluster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _start_server(self, server: _Server, replica_of: int | None) -> None:
        command = [
            "redis-server", "--port", str(server.port), "--bind", "127.0.0.1", "--dir", str(server.directory),
            "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip
        if replica_of is not None:
            command += ["--replicaof", "127.0.0.1", str(replica_of)]
        server.process = self._popen(command, server)
        self._wait(lambda: _answers(server.port), START_SECONDS, f"redis-server on {server.port}")

    @staticmethod
    def _popen(command: list[str], server: _Server) -> subprocess.Popen:
        with open(server.directory / "server.log", "ab") as log:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=server.directory)

    def _ready(self) -> bool:
        for sentinel in self.sentinels:
            state = _client(sentinel.port).sentinel_master(MASTER_NAME)
            if int(state.get("num-other-sentinels", 0)) + 1 < SENTINELS:
                return False
            if int(state.get("num-slaves", 0)) < self.replicas:
                return False
        return True

    def _promoted_other_than(self, old: int) -> bool:
        port = self.primary_port()
        return port != old and _client(port).info("replication").get("role") == "master"

    def _wait_replicas_in_sync(self, what: str) -> None:
        """Until every replica is online and has acknowledged the primary's offset as it was
        once they were online: after a full sync the primary streams to a replica only once
        it has acknowledged an offset (within a second), so "online" alone is not enough."""
        self._wait(lambda: len(self._replica_offsets()[1]) >= self.replicas, FAILOVER_SECONDS, what)
        target = self._replica_offsets()[0]
        self._wait(lambda: min(self._replica_offsets()[1]) >= target, FAILOVER_SECONDS, what)

    def _replica_offsets(self) -> tuple[int, list[int]]:
        """The primary's replication offset and each online replica's acknowledged one."""
        info = _client(self.primary_port()).info("replication")
        states = [info.get(f"slave{i}", {}) for i in range(int(info.get("connected_slaves", 0)))]
        return int(info["master_repl_offset"]), [
            int(s["offset"]) for s in states if s.get("state") == "online"
        ]

    @staticmethod
    def _wait(condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if condition():
                    return
            except (redis.RedisError, ClusterFailed):
                pass
            if time.monotonic() > deadline:
                raise ClusterFailed(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.05)


def _client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=2)


def _answers(port: int) -> bool:
    try:
        return bool(_client(port).ping())
    except redis.RedisError:
        return False
