"""A Redis primary, its replicas and three Sentinels on loopback ports, for `rlship chaos
--kill-redis-primary`, `rlship bench loop --replica` and the failover tests: each server in
its own directory, none keeping anything on disk, all ended by PID.

`fail_over` is the fault: SIGKILL the current primary, wait until the Sentinels have
promoted a replica, then start the killed server again as a replica of the new primary (as
an operator's supervisor would), and say how long the Sentinels took.

With `tls` (`ClusterTLS`) every server and Sentinel listens with TLS only and asks each
client for a certificate signed by the CA; replicas and Sentinels reach the servers over
TLS with the same certificate. ACL users are not replicated: `give_acl` gives its rules to
every server, and to a killed one again when it is started again.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

import redis

from orchestrator.commands.processes import redis_answers
from orchestrator.redis_topology import replica_states
from transport.zmq_sockets import free_port_pair

MASTER_NAME = "rlship"
SENTINELS = 3
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 2000  # a Sentinel tries the same master's failover again after twice this
START_SECONDS = 30.0
FAILOVER_SECONDS = 30.0


class ClusterFailed(RuntimeError):
    """The servers did not come up, or the Sentinels did not fail over, in time."""


@dataclass(frozen=True)
class ClusterTLS:
    """The files of TLS for every server and Sentinel: a CA, and a certificate (with its key)
    that the CA signed for 127.0.0.1, which servers present to clients and replicas and
    Sentinels present to servers. A client is given the same (`client_options`)."""

    ca: Path
    cert: Path
    key: Path

    def server_options(self, port: int) -> list[str]:
        return [
            "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.cert),
            "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.ca),
            "--tls-auth-clients", "yes", "--tls-replication", "yes",
        ]  # fmt: skip

    def config(self, port: int) -> str:
        """`server_options` as lines of a configuration file (a Sentinel's)."""
        options = iter(self.server_options(port))
        return "".join(f"{name[2:]} {value}\n" for name, value in zip(options, options, strict=True))

    def client_options(self) -> dict[str, str]:
        """As redis-py takes them in a URL's query."""
        return {"ssl_ca_certs": str(self.ca), "ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}


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
    tls: ClusterTLS | None = None
    servers: list[_Server] = field(default_factory=list)
    sentinels: list[_Server] = field(default_factory=list)
    acl: list[list[str]] = field(default_factory=list)  # ACL SETUSER lines every server is given

    @property
    def url(self) -> str:
        """The run's `redis_url`: kombu's Sentinel form, the master's name in the query (and,
        with TLS, the client's CA, certificate and key)."""
        chunks = ";".join(f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels)
        query = {"master_name": MASTER_NAME, **(self.tls.client_options() if self.tls else {})}
        return f"{chunks}/0?{urlencode(query)}"

    def clients(self) -> list[redis.Redis]:
        """A client of each running server (not the Sentinels)."""
        return [self._client(s.port) for s in self.servers if s.process and s.process.poll() is None]

    def give_acl(self, rules: list[list[str]]) -> None:
        """`rules` (`ACL SETUSER` lines, split) given to every server now, and to a server
        started again after a kill; replaces what was given before."""
        self.acl = rules
        for client in self.clients():
            for rule in rules:
                client.execute_command(*rule)

    def _client(self, port: int) -> redis.Redis:
        return _client(port, self.tls)

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
            listen = f"port {sentinel.port}\n" if self.tls is None else self.tls.config(sentinel.port)
            config.write_text(
                f"{listen}bind 127.0.0.1\ndir {sentinel.directory}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            sentinel.process = _popen(["redis-server", str(config), "--sentinel"], sentinel.directory)
            self.sentinels.append(sentinel)
        _wait(self._ready, START_SECONDS, "the primary, its replicas and three Sentinels to see each other")
        self._wait_replicas_in_sync("the replicas to catch up")
        return self

    def primary_port(self) -> int:
        """The primary's port: the one most Sentinels name, if it says it is the primary."""
        named = [port for port in self._named_ports() if port is not None]
        for port in sorted(set(named), key=named.count, reverse=True):
            role = self._client(port).info("replication").get("role")
            if 2 * named.count(port) > SENTINELS and role == "master":
                return port
        raise ClusterFailed(f"no primary named by most Sentinels (they name {named})")

    def _named_ports(self) -> list[int | None]:
        """Per Sentinel, the primary's port it names (None: it does not answer or name one)."""
        named: list[int | None] = []
        for sentinel in self.sentinels:
            try:
                host_port = self._client(sentinel.port).sentinel_get_master_addr_by_name(MASTER_NAME)
            except redis.RedisError:
                host_port = None
            named.append(int(host_port[1]) if host_port else None)
        return named

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
        # A Sentinel that lags would name the killed server, once started again, to a client
        # that asks it first: every Sentinel names the new primary before it starts.
        _wait(lambda: self.primary_port() != old, FAILOVER_SECONDS, f"a replica promoted after {old}")
        promoted = time.monotonic() - killed
        primary = self.primary_port()
        everyone = [primary] * SENTINELS
        _wait(lambda: self._named_ports() == everyone, FAILOVER_SECONDS, f"every Sentinel to name {primary}")
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
        server.process = start_redis_server(server.directory, server.port, replica_of, self.tls)
        client = self._client(server.port)
        for rule in self.acl:
            client.execute_command(*rule)

    def _ready(self) -> bool:
        for sentinel in self.sentinels:
            state = self._client(sentinel.port).sentinel_master(MASTER_NAME)
            if int(state.get("num-other-sentinels", 0)) + 1 < SENTINELS:
                return False
            if int(state.get("num-slaves", 0)) < self.replicas:
                return False
        return True

    def _wait_replicas_in_sync(self, what: str) -> None:
        """Until every replica is online and has acknowledged the primary's offset as it was
        once they were online: after a full sync the primary streams to a replica only once
        it has acknowledged an offset (within a second), so "online" alone is not enough. A
        replica may drop out again meanwhile (a Sentinel reconfiguring the one just started),
        so every check counts them again."""

        def in_sync(target: int) -> bool:
            offsets = self._replica_offsets()[1]
            return len(offsets) >= self.replicas and min(offsets) >= target

        _wait(lambda: in_sync(0), FAILOVER_SECONDS, what)
        target = self._replica_offsets()[0]
        _wait(lambda: in_sync(target), FAILOVER_SECONDS, what)

    def _replica_offsets(self) -> tuple[int, list[int]]:
        """The primary's replication offset and each online replica's acknowledged one."""
        info = self._client(self.primary_port()).info("replication")
        return int(info["master_repl_offset"]), [
            int(s["offset"]) for s in replica_states(info) if s.get("state") == "online"
        ]


def start_redis_server(
    directory: Path, port: int, replica_of: int | None = None, tls: ClusterTLS | None = None
) -> subprocess.Popen:
    """A redis-server on loopback that keeps nothing on disk (a replica of `replica_of`, if
    given; with `tls`, listening with TLS only), logging in `directory`; returns once it answers."""
    directory.mkdir(parents=True, exist_ok=True)
    listen = tls.server_options(port) if tls is not None else ["--port", str(port)]
    command = [
        "redis-server", *listen, "--bind", "127.0.0.1", "--dir", str(directory),
        "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0",
    ]  # fmt: skip
    if replica_of is not None:
        command += ["--replicaof", "127.0.0.1", str(replica_of)]
    server = _popen(command, directory)
    url = (
        f"rediss://127.0.0.1:{port}/0?{urlencode(tls.client_options())}"
        if tls is not None
        else f"redis://127.0.0.1:{port}/0"
    )
    _wait(lambda: redis_answers(url), START_SECONDS, f"redis-server on {port}")
    return server


def _popen(command: list[str], directory: Path) -> subprocess.Popen:
    with open(directory / "server.log", "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=directory)


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
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


def _client(port: int, tls: ClusterTLS | None = None) -> redis.Redis:
    secure = {"ssl": True, **tls.client_options()} if tls is not None else {}
    return redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=2, **secure)
