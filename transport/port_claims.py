"""Who holds a ZMQ port pair: which run of this Redis, and which process on this machine.

Two runs of one Redis never ship on the same ports: a run claims its pair in Redis (one key
per port, `ship_port_claim`, the run id as value, with an expiry its orchestrator renews
with its lease). `rlship run` claims the pair before it starts anything and the
orchestrator holds the claim while it lives, so a second run is refused (or, left at the
default port with its own trainer ranks, moved to a free pair) before a rank of it can
connect to the first run's sender. A port held outside rlship shows when the ship worker
binds: `port_holder` names the process, for the line that stops the run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import psutil
import redis

from transport.keys import ship_port_claim, ship_port_claim_pattern, ship_port_of_claim

# KEYS: the claims of the pair's two ports; ARGV: run id, seconds. Returns the run holding
# either port, or nothing once both are this run's (claimed, or renewed).
CLAIM_PORTS_LUA = """
for _, key in ipairs(KEYS) do
  local holder = redis.call('GET', key)
  if holder and holder ~= ARGV[1] then return holder end
end
for _, key in ipairs(KEYS) do redis.call('SET', key, ARGV[1], 'EX', tonumber(ARGV[2])) end
return false
"""

# KEYS: the claims of the pair's two ports; ARGV: run id. Deletes only this run's claims.
RELEASE_PORTS_LUA = """
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('DEL', key) end
end
return 0
"""


def claim_call(run_id: str, host: str, port: int, seconds: int) -> tuple[str | int, ...]:
    """`EVAL` arguments that claim (or renew) `host:port` and the READY port after it for
    `run_id`; the reply is the run holding either, or None. For a sync or an async client."""
    return (CLAIM_PORTS_LUA, 2, ship_port_claim(host, port), ship_port_claim(host, port + 1), run_id, seconds)


def release_call(run_id: str, host: str, port: int) -> tuple[str | int, ...]:
    """`EVAL` arguments that delete `run_id`'s claims of the pair (another run's stay)."""
    return (RELEASE_PORTS_LUA, 2, ship_port_claim(host, port), ship_port_claim(host, port + 1), run_id)


def claim_holder(reply: bytes | str | None) -> str | None:
    """The run a claim's reply names, or None when the claim is this run's."""
    return reply.decode() if isinstance(reply, bytes) else reply


def other_claimants(client: redis.Redis, run_id: str, host: str, port: int) -> list[str]:
    """The live runs of this Redis other than `run_id` that claim `host:port` or the port
    after it."""
    held = client.mget(ship_port_claim(host, port), ship_port_claim(host, port + 1))
    return sorted({claimant.decode() for claimant in held if claimant is not None} - {run_id})


@dataclass(frozen=True)
class PortClaim:
    host: str
    port: int
    run_id: str
    expires_in: int


def port_claims(client: redis.Redis) -> list[PortClaim]:
    """Every port claimed by a live run of this Redis, by address."""
    claims = []
    for key in client.scan_iter(match=ship_port_claim_pattern(), count=1000):
        pipe = client.pipeline(transaction=False)
        pipe.get(key).ttl(key)
        run_id, ttl = pipe.execute()
        if run_id is not None:
            host, port = ship_port_of_claim(key.decode())
            claims.append(PortClaim(host, port, run_id.decode(), max(int(ttl), 0)))
    return sorted(claims, key=lambda c: (c.host, c.port))


def port_holder(port: int) -> str | None:
    """The process listening on `port` on this machine, as `pid N (command line)`, or None
    where it cannot be seen (another user's process without the rights to look)."""
    with contextlib.suppress(psutil.Error, OSError):
        for connection in psutil.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
                with contextlib.suppress(psutil.Error):
                    command = " ".join(psutil.Process(connection.pid).cmdline())[:120]
                    return f"pid {connection.pid} ({command})"
                return f"pid {connection.pid}"
    return None
