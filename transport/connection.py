"""Redis clients that ride out a Redis restart or a Sentinel failover.

Every process (orchestrator, workers, trainer ranks, producer, the commands) gets its clients
here, so they share one policy: a command that fails on a lost connection is retried with
backoff for about `OUTAGE_SECONDS`, long enough for a restart or a failover, short enough
that a Redis that stays down ends the process with a clear error instead of a hang.

A run's Redis is a URL (`redis://`, `rediss://`, `unix://`) or Sentinels and the name of the
primary they watch (`RedisAddress`): `sentinel://[:password@]host:port;sentinel://host:port
/db?master_name=NAME`, kombu's form with the master's name in the query. With Sentinels a
client asks them for the primary at each connect, so a failover is one more lost connection.
TLS is `rediss://` (or, with Sentinels, any TLS option) with the CA, certificate and key in
the query as redis-py reads them (`TLS_OPTIONS`); this module hands them to every client,
the Sentinels, kombu's broker and Celery's result backend included.

Retrying is safe for rlship's writes: they are idempotent (SET, HSET, SADD, marks), guarded
(the record is written in a WATCH transaction, which redis-py does not replay: the
WatchError sends the publisher round its check again), or counters whose rare double count
after a lost reply costs only a statistic.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import kombu.transport
import kombu.transport.redis
import redis
import redis.asyncio as aioredis
import redis.asyncio.connection
import redis.asyncio.sentinel
import redis.connection
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

from transport.script_pipelines import AsyncScriptSafeRedis, ScriptSafeRedis

log = logging.getLogger("rlship.redis")

OUTAGE_SECONDS = 30.0
FAILOVER_WAIT_SECONDS = 10.0  # a Celery worker's connect waits this long for a new primary
_BACKOFF = {"cap": 1.0, "base": 0.05}
# 0.05, 0.1, ... capped at 1 s: about OUTAGE_SECONDS in all.
_RETRIES = 5 + int(OUTAGE_SECONDS)


# Replies are parsed by hiredis (a dependency: redis-py takes its parser whenever it is
# installed), in C: an MGET of a rank's 128 prepared samples (3 MiB) costs 0.9 ms of CPU,
# against 2.7 ms with redis-py's Python parser reading them. Commands are packed by redis-py's
# own serializer, which sends a large value (a payload, a rollout's arrays) as it is, where
# hiredis's packer copies it into one buffer (3 MiB: 0.6 -> 6 ms). BENCHMARKS.md, "Replies
# parsed by hiredis".
PACK_BUFFER_CUTOFF = 6000  # redis-py's own: a value longer than this is sent without a copy
_PYTHON_PACKER = redis.connection.PythonRespSerializer(
    PACK_BUFFER_CUTOFF, redis.connection.Encoder("utf-8", "strict", False).encode
)


class _AsyncPythonPacking:
    """A redis.asyncio connection that packs its commands with redis-py's Python serializer
    (`_PYTHON_PACKER`'s reason): redis.asyncio takes hiredis's packer whenever hiredis is
    installed and has no option for it, but packs in Python when it has none."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._command_packer = None


class _AsyncConnection(_AsyncPythonPacking, redis.asyncio.connection.Connection):
    """`redis://`."""


class _AsyncSSLConnection(_AsyncPythonPacking, redis.asyncio.connection.SSLConnection):
    """`rediss://`."""


class _AsyncUnixConnection(_AsyncPythonPacking, redis.asyncio.connection.UnixDomainSocketConnection):
    """`unix://`."""


class _Failover:
    """Says in this process's log when its Redis primary stopped answering (a failover under
    way, most likely) and which primary answered again, and after how long: once each. A
    process that never reached a primary says nothing here: its command reports that."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.reached = False
        self.lock = threading.Lock()

    def failed(self, exc: Exception) -> None:
        with self.lock:
            if self.reached and self.since is None:
                self.since = time.time()
                log.warning(
                    "Redis primary unreachable since %s (%s): failing over? Asking the Sentinels again",
                    time.strftime("%H:%M:%S", time.localtime(self.since)),
                    exc,
                )

    def connected(self, host: str, port: int) -> None:
        self.reached = True
        if self.since is None:
            return
        with self.lock:
            if self.since is not None:
                seconds = time.time() - self.since
                log.warning("Redis primary is %s:%d again, after %.1f s", host, port, seconds)
                self.since = None


_failover = _Failover()


class _PrimaryConnection(redis.sentinel.SentinelManagedConnection):
    """redis-py's Sentinel-managed connection, but a reconnect on the way to sending a
    command asks the Sentinels too: redis-py's `send_packed_command` reconnects with
    `connect_check_health`, to the address the connection last had, so after a failover a
    connection dropped for a READONLY reply reconnected to the old primary, now a replica,
    until its retries ran out (seen here: an orchestrator stopped 30 s after a failover)."""

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        try:
            if not self._sock and self.connection_pool.is_master:
                self.host, self.port = self.connection_pool.get_master_address()
            super().connect_check_health(check_health, retry_socket_connect)
        except ConnectionError as exc:
            _failover.failed(exc)
            raise
        _failover.connected(self.host, self.port)


class _PrimarySSLConnection(_PrimaryConnection, redis.connection.SSLConnection):
    """`_PrimaryConnection` over TLS."""


class _AsyncPrimaryConnection(_AsyncPythonPacking, redis.asyncio.sentinel.SentinelManagedConnection):
    """`_PrimaryConnection` for redis.asyncio."""

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        try:
            if not self.is_connected and self.connection_pool.is_master:
                self.host, self.port = await self.connection_pool.get_master_address()
            await super().connect_check_health(check_health, retry_socket_connect)
        except ConnectionError as exc:
            _failover.failed(exc)
            raise
        _failover.connected(self.host, self.port)


class _KombuPrimaryConnection(_PrimaryConnection):
    """`_PrimaryConnection` for kombu, which reconnects a worker with waits of 2, 4, 6 s
    between rounds: a connect waits out a failover (up to `FAILOVER_WAIT_SECONDS`) instead,
    so a worker consumes again as soon as the Sentinels name the new primary, not at the
    round after it (measured here: 6 s from the kill, against 2 to 4 s for the promotion)."""

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        deadline = time.monotonic() + FAILOVER_WAIT_SECONDS
        while True:
            try:
                return super().connect_check_health(check_health, retry_socket_connect)
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


class _AsyncPrimarySSLConnection(_AsyncPrimaryConnection, redis.asyncio.connection.SSLConnection):
    """`_AsyncPrimaryConnection` over TLS."""


class _KombuPrimarySSLConnection(_KombuPrimaryConnection, redis.connection.SSLConnection):
    """`_KombuPrimaryConnection` over TLS."""


class _KombuSentinelChannel(kombu.transport.redis.SentinelChannel):
    connection_class = _KombuPrimaryConnection
    connection_class_ssl = _KombuPrimarySSLConnection

    def _get_pool(self, asynchronous: bool = False) -> Any:
        """A late acknowledgement run while a lost broker connection is being closed asks
        for a pool after kombu let go of the connection: raise the connection error kombu
        logs and recovers from (the message is delivered again), not the AttributeError
        that left a worker's consumer stopped for good (seen here after a failover)."""
        if self.connection.client is None:
            raise ConnectionError("the broker connection is closed")
        return super()._get_pool(asynchronous)


class KombuSentinelTransport(kombu.transport.redis.SentinelTransport):
    """kombu's Sentinel transport on `_PrimaryConnection`: without it a Celery worker whose
    broker connection was dropped after a failover reconnected to the old primary and
    consumed nothing (seen here: a run stalled with its tasks waiting in the queue)."""

    Channel = _KombuSentinelChannel


SENTINEL_SCHEME = "sentinel"
TLS_SCHEME = "rediss"
# kombu picks a transport by the URL's scheme, again at every switch to the next Sentinel:
# the scheme itself names this one (kombu's registry of transports).
kombu.transport.TRANSPORT_ALIASES[SENTINEL_SCHEME] = f"{__name__}:KombuSentinelTransport"
DEFAULT_SENTINEL_PORT = 26379
# A Sentinel that does not answer must not hold up finding the primary: ask the next one.
_SENTINEL_OPTIONS = {"socket_connect_timeout": 1.0, "socket_timeout": 1.0}
# What a client needs to speak TLS to the run's Redis, named as redis-py reads them from a
# URL's query and as kombu (`broker_use_ssl`) and Celery (`redis_backend_use_ssl`) take them:
# only these, so that every client of the run is given the same.
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
CERT_REQUIREMENTS = ("required", "optional", "none")


def _tls_options(url: str, scheme: str) -> dict[str, str]:
    """The TLS options in `url`'s query; a name rlship does not pass on, a file that is not
    there or TLS options on a plain connection raise ValueError naming it."""
    query = parse_qs(urlsplit(url).query)
    tls = {name: values[-1] for name, values in query.items() if name in TLS_OPTIONS}
    others = sorted(name for name in query if name.startswith("ssl") and name not in TLS_OPTIONS)
    if others:
        raise ValueError(
            f"{', '.join(others)}: the TLS options rlship passes on are {', '.join(TLS_OPTIONS)}"
        )
    if tls and scheme not in (TLS_SCHEME, SENTINEL_SCHEME):
        raise ValueError(f"TLS options ({', '.join(tls)}) need a {TLS_SCHEME}:// URL, not {scheme}://")
    if tls.get("ssl_cert_reqs", "required") not in CERT_REQUIREMENTS:
        raise ValueError(
            f"ssl_cert_reqs must be one of {', '.join(CERT_REQUIREMENTS)}, not {tls['ssl_cert_reqs']!r}"
        )
    for name in TLS_FILES:
        if name in tls and not os.path.isfile(tls[name]):
            raise ValueError(f"{name}: there is no file {tls[name]!r}")
    return tls


@dataclass(frozen=True)
class RedisAddress:
    """Where a run's Redis is: a plain URL, or the Sentinels and the master name they watch;
    with `tls`, reached over TLS (the Sentinels too)."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    master_name: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: tuple[tuple[str, str], ...] = ()
    uses_tls: bool = False

    @property
    def is_sentinel(self) -> bool:
        return bool(self.sentinels)

    @property
    def celery_url(self) -> str:
        """The URL as kombu and Celery take it: the master's name goes in their transport
        options and the TLS options in their own settings (`celery_redis_options`), not in
        the URL."""
        if self.is_sentinel:
            return self.url.split("?", 1)[0]
        parts = urlsplit(self.url)
        query = [(name, value) for name, value in parse_qsl(parts.query) if name not in TLS_OPTIONS]
        return urlunsplit(parts._replace(query=urlencode(query)))

    @classmethod
    def parse(cls, url: str) -> RedisAddress:
        """Read `url`; a malformed address raises ValueError naming what is wrong."""
        scheme = urlsplit(url).scheme
        if scheme != SENTINEL_SCHEME:
            tls = _tls_options(url, scheme)
            return cls(url, tls=tuple(tls.items()), uses_tls=scheme == TLS_SCHEME)
        sentinels: list[tuple[str, int]] = []
        found: dict[str, Any] = {}
        tls = {}
        for chunk in url.split(";"):
            parts = urlsplit(chunk)
            if parts.scheme != SENTINEL_SCHEME or not parts.hostname:
                raise ValueError(f"each Sentinel must be given as sentinel://host:port, not {chunk!r}")
            sentinels.append((parts.hostname, parts.port or DEFAULT_SENTINEL_PORT))
            tls.update(_tls_options(chunk, SENTINEL_SCHEME))
            if parts.password is not None:
                found["password"] = unquote(parts.password)
                found["username"] = unquote(parts.username) if parts.username else None
            if parts.path.strip("/"):
                if not parts.path.strip("/").isdigit():
                    raise ValueError(
                        f"the database after a Sentinel must be a number (as /0), not {parts.path!r}"
                    )
                found["db"] = int(parts.path.strip("/"))
            names = parse_qs(parts.query).get("master_name")
            if names:
                found["master_name"] = names[0]
        if not found.get("master_name"):
            raise ValueError(
                "a sentinel:// address needs the name of the primary its Sentinels watch, as "
                "?master_name=NAME at its end"
            )
        return cls(url, tuple(sentinels), **found, tls=tuple(tls.items()), uses_tls=bool(tls))

    def tls_options(self) -> dict[str, str]:
        """The TLS options every client is given (none without TLS); a certificate is
        required unless the URL says otherwise."""
        return {"ssl_cert_reqs": "required", **dict(self.tls)} if self.uses_tls else {}

    def sentinel_options(self) -> dict[str, Any]:
        """How a client of a Sentinel itself connects: short timeouts, TLS as the primary."""
        return {**_SENTINEL_OPTIONS, **({"ssl": True, **self.tls_options()} if self.uses_tls else {})}

    def sentinel(self, **options: Any) -> redis.sentinel.Sentinel:
        """A client of the Sentinels themselves (topology, `rlship doctor`)."""
        return redis.sentinel.Sentinel(
            list(self.sentinels), sentinel_kwargs=self.sentinel_options(), **options
        )

    def master_options(self) -> dict[str, Any]:
        return {"db": self.db, "username": self.username, "password": self.password, **self.tls_options()}

    def primary(self, **options: Any) -> redis.Redis:
        """A client of the primary the Sentinels name, following it through a failover."""
        connection_class = _PrimarySSLConnection if self.uses_tls else _PrimaryConnection
        return self.sentinel().master_for(
            self.master_name,
            connection_class=connection_class,
            redis_class=ScriptSafeRedis,
            **{**self.master_options(), **options},
        )


def with_credentials(url: str, auth: str) -> str:
    """`url` with its user and password replaced by `auth` (`USER:PASSWORD`, a role's:
    `rlship acl`); with Sentinels, the primary's (the Sentinels are asked without)."""
    user, _, password = auth.partition(":")
    chunks = [urlsplit(chunk) for chunk in url.split(";")]
    chunks = [parts._replace(netloc=parts.netloc.rpartition("@")[2]) for parts in chunks]
    userinfo = f"{quote(user, safe='')}:{quote(password, safe='')}@"
    chunks[0] = chunks[0]._replace(netloc=userinfo + chunks[0].netloc)
    return ";".join(urlunsplit(parts) for parts in chunks)


def celery_redis_options(url: str) -> dict[str, Any]:
    """Celery settings for a broker and result backend on `url`: with Sentinels, kombu's
    `sentinel://` URL and the master's name in both transport options; with TLS, its
    options in `broker_use_ssl` and `redis_backend_use_ssl` (kombu would otherwise take a
    `rediss://` URL without them as TLS that checks no certificate)."""
    address = RedisAddress.parse(url)
    options: dict[str, Any] = {"broker_url": address.celery_url, "result_backend": address.celery_url}
    if address.is_sentinel:
        extra = {"master_name": address.master_name, "sentinel_kwargs": address.sentinel_options()}
        options["broker_transport_options"] = extra
        options["result_backend_transport_options"] = extra
    if address.uses_tls:
        options["broker_use_ssl"] = address.tls_options()
        options["redis_backend_use_ssl"] = address.tls_options()
    return options


def _retry_options(ride_out_outages: bool) -> dict[str, Any]:
    if not ride_out_outages:
        return {"retry": None}
    return {
        "retry": Retry(ExponentialBackoff(**_BACKOFF), _RETRIES),
        "retry_on_error": [ConnectionError, TimeoutError],
    }


def connect_redis(url: str, *, ride_out_outages: bool = True, **options: Any) -> redis.Redis:
    """A client of the run's Redis (its primary, with Sentinels) that rides out a restart or
    a failover, its replies parsed by hiredis and its commands packed without copying large
    values (`_PYTHON_PACKER`); without `ride_out_outages`, a lost connection fails at once (a
    command that checks whether Redis answers)."""
    options["command_packer"] = _PYTHON_PACKER
    options.update(_retry_options(ride_out_outages))
    address = RedisAddress.parse(url)
    if address.is_sentinel:
        return address.primary(**options)
    return ScriptSafeRedis.from_url(url, **options)


def connect_redis_async(url: str, **options: Any) -> aioredis.Redis:
    retry = {
        "retry": AsyncRetry(ExponentialBackoff(**_BACKOFF), _RETRIES),
        "retry_on_error": [ConnectionError, TimeoutError],
    }
    address = RedisAddress.parse(url)
    if address.is_sentinel:
        sentinels = redis.asyncio.sentinel.Sentinel(
            list(address.sentinels), sentinel_kwargs=address.sentinel_options()
        )
        return sentinels.master_for(
            address.master_name,
            connection_class=_AsyncPrimarySSLConnection if address.uses_tls else _AsyncPrimaryConnection,
            redis_class=AsyncScriptSafeRedis,
            **address.master_options(),
            **retry,
            **options,
        )
    scheme = urlsplit(url).scheme
    connection_class = {"rediss": _AsyncSSLConnection, "unix": _AsyncUnixConnection}.get(
        scheme, _AsyncConnection
    )
    return AsyncScriptSafeRedis.from_url(url, connection_class=connection_class, **retry, **options)
