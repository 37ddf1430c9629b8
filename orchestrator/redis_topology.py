"""What the run's Redis is made of: with Sentinels, the primary they name, its replicas (how
far behind each is) and which Sentinels answer; shown by `rlship doctor` and `rlship status`,
and checked at start-up against `redis_wait_replicas` (a primary with fewer replicas online
would hold every write the run waits on)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import redis

from transport.connection import RedisAddress


@dataclass(frozen=True)
class Replica:
    address: str
    online: bool
    behind_bytes: int  # the primary's replication offset less the replica's acknowledged one
    lag_seconds: int  # since the replica last acknowledged


@dataclass
class RedisTopology:
    primary: str
    replicas: list[Replica] = field(default_factory=list)
    sentinels_answering: int = 0
    sentinels: int = 0

    @property
    def online(self) -> int:
        return sum(replica.online for replica in self.replicas)

    def line(self, wait_replicas: int, wait_timeout_ms: int) -> str:
        replicas = ", ".join(
            f"{r.address} ({'online' if r.online else 'not online'}, {r.behind_bytes} bytes and "
            f"{r.lag_seconds} s behind)"
            for r in self.replicas
        )
        sentinels = ""
        if self.sentinels:
            sentinels = f"; Sentinels answering {self.sentinels_answering} of {self.sentinels}"
        return (
            f"primary {self.primary}; replicas: {replicas or 'none'}{sentinels}; "
            f"writes wait for {wait_replicas} replica(s) (WAIT, {wait_timeout_ms} ms a round)"
        )


def replica_states(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Each connected replica's state (ip, port, state, offset, lag) from a primary's
    `INFO replication`."""
    return [info.get(f"slave{index}", {}) for index in range(int(info.get("connected_slaves", 0)))]


def read_topology(url: str, primary: redis.Redis) -> RedisTopology:
    """The topology as the primary (`primary`, a client of it) and the Sentinels see it."""
    info = primary.info("replication")
    offset = int(info.get("master_repl_offset", 0))
    replicas = [
        Replica(
            f"{state.get('ip')}:{state.get('port')}",
            state.get("state") == "online",
            max(0, offset - int(state.get("offset", 0))),
            int(state.get("lag", 0)),
        )
        for state in replica_states(info)
    ]
    address = RedisAddress.parse(url)
    connection = primary.connection_pool.connection_kwargs
    where = f"{connection.get('host', '?')}:{connection.get('port', '?')}"
    answering = 0
    if address.is_sentinel:
        named = address.sentinel().discover_master(address.master_name)
        where = f"{named[0]}:{named[1]} (master_name {address.master_name!r})"
        for host, port in address.sentinels:
            sentinel = redis.Redis(host=host, port=port, **address.sentinel_options())
            with contextlib.suppress(redis.RedisError):
                answering += bool(sentinel.ping())
    return RedisTopology(where, replicas, answering, len(address.sentinels))
