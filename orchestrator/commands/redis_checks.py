"""Checks of the run's Redis: it answers (or can be started here), with the password and
database right, it keeps what it is given (no eviction, persistence as the run needs), and
the replicas a run waits for are there. Every URL is shown through `mask_secrets`."""

from __future__ import annotations

import shutil
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis
from redis.sentinel import MasterNotFoundError

from orchestrator.commands.findings import Check
from orchestrator.redis_topology import read_topology
from orchestrator.settings import RunSettings
from tasks.logs import mask_secrets
from transport.connection import RedisAddress, connect_redis

REDIS_TIMEOUT_SECONDS = 2.0
# The commands a supervisor starts together with Redis (honcho, compose) wait this long for it.
REDIS_WAIT_SECONDS = 10.0


@dataclass(frozen=True)
class RedisAnswer:
    """How the Redis at a URL answered: `client` when it did, else why not (`unreachable`,
    `auth`, `database`) in `check`."""

    check: Check
    reason: str
    client: redis.Redis | None = None


def probe_redis(url: str) -> RedisAnswer:
    """One ping with short timeouts and no retries: reachable, authenticated, database selected."""
    shown = mask_secrets(url)
    client = connect_redis(
        url,
        ride_out_outages=False,
        socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
        socket_timeout=REDIS_TIMEOUT_SECONDS,
    )
    try:
        client.ping()
    except MasterNotFoundError as exc:
        address = RedisAddress.parse(url)
        detail = f"no Sentinel at {shown} names a primary for master_name {address.master_name!r} ({exc})"
        fix = "start the Sentinels, or correct the addresses or the master_name in REDIS_URL"
        return RedisAnswer(Check("redis", False, detail, fix), "unreachable")
    except redis.AuthenticationError:
        return RedisAnswer(_auth_failed(client, shown), "auth")
    except (redis.ConnectionError, redis.TimeoutError, OSError, redis.exceptions.InvalidResponse) as exc:
        if (answer := _not_redis_answer(client)) is not None:
            detail = f"what answers at {shown} is not Redis (it said {answer!r})"
            return RedisAnswer(
                Check("redis", False, detail, "correct the host and port in REDIS_URL"), "not_redis"
            )
        fix = "start Redis there (or let `rlship run` start one) or correct REDIS_URL / --redis-url"
        return RedisAnswer(Check("redis", False, f"no Redis answers at {shown} ({exc})", fix), "unreachable")
    except redis.ResponseError as exc:
        message = str(exc)
        if "NOAUTH" in message or "WRONGPASS" in message or "password" in message.lower():
            return RedisAnswer(_auth_failed(client, shown), "auth")
        if "DB index" in message:
            database = client.connection_pool.connection_kwargs.get("db", 0)
            detail = f"redis_url={shown}: database {database} does not exist on that server ({message})"
            fix = "use a database number the server has (0 to `databases` - 1)"
            return RedisAnswer(Check("redis", False, detail, fix), "database")
        return RedisAnswer(Check("redis", False, f"Redis at {shown} refused a ping: {message}", ""), "error")
    version = client.info("server").get("redis_version", "?")
    answers = f"Redis {version} answers at {shown}"
    options = client.connection_pool.connection_kwargs
    if not options.get("password"):
        return RedisAnswer(Check("redis", True, f"{answers}, no password asked or given"), "ok", client)
    if _answers_without_password(url, client):
        unasked = Check(
            "redis",
            False,
            f"{answers}, but it asks for no password: the one in the URL is not checked",
            "set requirepass (or an ACL user) on the server, or leave the password out of REDIS_URL",
            fatal=False,
        )
        return RedisAnswer(unasked, "ok", client)
    return RedisAnswer(Check("redis", True, f"{answers}, the password accepted"), "ok", client)


def _answers_without_password(url: str, client: redis.Redis) -> bool:
    """Whether the server behind `client` answers a client that gives no password."""
    address = RedisAddress.parse(url)
    if address.is_sentinel:
        bare = address.primary(username=None, password=None, retry=None)
    else:
        pool = client.connection_pool
        options = {**pool.connection_kwargs, "password": None, "username": None}
        bare = redis.Redis(
            connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **options)
        )
    try:
        return bool(bare.ping())
    except redis.RedisError:
        return False
    finally:
        bare.close()


def _not_redis_answer(client: redis.Redis) -> bytes | None:
    """What a server that is not Redis answers a raw PING with (an HTTP server's status
    line, say), or None when nothing answers or what answers speaks Redis's protocol."""
    options = client.connection_pool.connection_kwargs
    if "path" in options:  # a unix socket: only Redis would be there
        return None
    if issubclass(client.connection_pool.connection_class, redis.SSLConnection):
        return None  # TLS: its error (a certificate refused) says more than a raw PING would
    try:
        with socket.create_connection(
            (options.get("host", "localhost"), options.get("port", 6379)), 1
        ) as raw:
            raw.settimeout(REDIS_TIMEOUT_SECONDS)
            raw.sendall(b"PING\r\n")
            answer = raw.recv(64)
    except OSError:
        return None
    return answer.splitlines()[0] if answer and answer[:1] not in b"+-" else None


def _auth_failed(client: redis.Redis, shown: str) -> Check:
    """One message per case: no password given where one is asked, or the one given refused."""
    if not client.connection_pool.connection_kwargs.get("password"):
        detail = f"Redis at {shown} asks for a password and the URL gives none"
        return Check("redis", False, detail, "put it in REDIS_URL (redis://:PASSWORD@host:port/db)")
    detail = f"Redis at {shown} refused the credentials: a wrong password (or user)"
    return Check(
        "redis", False, detail, "put the right password in REDIS_URL (redis://:PASSWORD@host:port/db)"
    )


def wait_for_redis(url: str, seconds: float = REDIS_WAIT_SECONDS) -> RedisAnswer:
    """Like `probe_redis`, but an unreachable Redis is given `seconds` to come up (a supervisor
    may start it beside this process); a refused password or database fails at once."""
    deadline = time.monotonic() + seconds
    while True:
        answer = probe_redis(url)
        if answer.reason != "unreachable" or time.monotonic() >= deadline:
            return answer
        time.sleep(0.5)


def redis_can_be_started(url: str) -> Check:
    """`rlship run` starts a Redis when none answers: on a local TCP URL, with redis-server."""
    if RedisAddress.parse(url).is_sentinel:
        detail = f"no Sentinel at {mask_secrets(url)} names a primary that answers"
        fix = "rlship starts a Redis of its own only for a redis:// URL"
        return Check("redis-server", False, detail, fix)
    host = urlsplit(url).hostname or "127.0.0.1"
    local = urlsplit(url).scheme == "redis" and host in ("127.0.0.1", "localhost", "::1")
    path = shutil.which("redis-server")
    if path and local:
        return Check("redis-server", True, f"none answers at {mask_secrets(url)}; {path} will start one")
    if not local:
        detail = f"no Redis answers at {mask_secrets(url)}, and rlship starts one only on 127.0.0.1"
        return Check("redis-server", False, detail, "start Redis on that host, or correct REDIS_URL")
    return Check(
        "redis-server",
        False,
        f"no Redis answers at {mask_secrets(url)}, and redis-server is not on PATH to start one",
        "install it (`apt-get install redis-server`) or point REDIS_URL at a running Redis",
    )


def redis_keeps_data(client: redis.Redis, allow_eviction: bool, replicated: bool = False) -> list[Check]:
    """Eviction (payloads and queued tasks could vanish) and persistence (a restart loses the
    run, unless its writes wait for replicas: `replicated`, see `redis_replicas`)."""
    memory = client.info("memory")
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    limit = int(memory.get("maxmemory", 0))
    limit_text = f"maxmemory {limit // 2**20} MiB" if limit else "no maxmemory"
    if policy == "noeviction":
        eviction = Check("eviction", True, f"maxmemory-policy noeviction ({limit_text})")
    else:
        eviction = Check(
            "eviction",
            False,
            f"Redis evicts keys (maxmemory-policy {policy}, {limit_text}): payloads and tasks could vanish",
            "`CONFIG SET maxmemory-policy noeviction` (or --allow-eviction to run anyway)",
            fatal=not allow_eviction,
        )
    persistence = client.info("persistence")
    if int(persistence.get("aof_enabled", 0)):
        kept = Check("persistence", True, "append-only file on: a restarted Redis keeps the run")
    elif replicated:
        kept = Check("persistence", True, "the run's writes wait for replicas: a failover keeps the run")
    else:
        kept = Check(
            "persistence",
            False,
            "no append-only file: a Redis restart loses the run in flight (rlship exits 3 naming it)",
            "`CONFIG SET appendonly yes` for runs that must survive a Redis restart",
            fatal=False,
        )
    return [eviction, kept]


def redis_replicas(client: redis.Redis, settings: RunSettings, *, fatal: bool = True) -> list[Check]:
    """With Sentinels, or writes that wait for replicas: the topology, and enough replicas
    online for `redis_wait_replicas` (fewer would hold every write the run waits on). Not
    `fatal` for a process a supervisor may restart mid-run, in a failover: it waits instead."""
    wanted = settings.redis_wait_replicas or 0
    if wanted == 0 and not RedisAddress.parse(settings.redis_url).is_sentinel:
        return []
    try:
        topology = read_topology(settings.redis_url, client)
    except redis.RedisError as exc:
        return [Check("replicas", False, f"the Sentinels' view could not be read: {exc}", "", fatal=False)]
    line = topology.line(wanted, settings.redis_wait_timeout_ms)
    if topology.online < wanted:
        detail = (
            f"redis_wait_replicas={wanted} but {topology.online} replica(s) are online: every write "
            f"exactly-once depends on would wait ({line})"
        )
        fix = "start a replica of the primary, or lower redis_wait_replicas"
        return [Check("replicas", False, detail, fix, fatal=fatal)]
    if wanted == 0:
        lost = "redis_wait_replicas=0: a failover may lose the writes the primary had not replicated"
        return [Check("replicas", False, f"{line}; {lost}", "set redis_wait_replicas to 1", fatal=False)]
    return [Check("replicas", True, line)]


def redis_checks(settings: RunSettings, answer: RedisAnswer, *, replicas_fatal: bool = True) -> list[Check]:
    if answer.client is None:
        return [answer.check]
    return [
        answer.check,
        *redis_keeps_data(answer.client, settings.allow_eviction, bool(settings.redis_wait_replicas)),
        *redis_replicas(answer.client, settings, fatal=replicas_fatal),
    ]
