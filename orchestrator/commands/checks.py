"""What a run needs before it starts, checked in seconds: shared by `rlship run` (and the
other commands, each for what applies to it) and `rlship doctor`.

Each check returns a `Check`: one line naming what was found, and for a failure what to do.
An operator mistake (a wrong password, a port in use, a database that does not exist, an
unwritable directory) must stop a run at once with that line, not hang it or end it in a
traceback; secrets never appear (every URL is shown through `mask_secrets`).
"""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import redis
from redis.sentinel import MasterNotFoundError

from orchestrator.redis_topology import read_topology
from orchestrator.settings import RunSettings
from orchestrator.worker_queries import queue_consumers
from tasks.logs import mask_secrets
from transport.connection import RedisAddress, connect_redis
from transport.keys import RunKeys
from transport.port_claims import other_claimants, port_claims, port_holder

REDIS_TIMEOUT_SECONDS = 2.0
# The commands a supervisor starts together with Redis (honcho, compose) wait this long for it.
REDIS_WAIT_SECONDS = 10.0


@dataclass(frozen=True)
class Check:
    """One finding. `fix` says what to do when it failed; a failed `fatal` check stops a run."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    fatal: bool = True

    def line(self) -> str:
        mark = "ok  " if self.ok else ("FAIL" if self.fatal else "warn")
        return f"{mark} {self.name}: {self.detail}" + ("" if self.ok or not self.fix else f" -> {self.fix}")


class ChecksFailed(SystemExit):
    """A run that cannot start: the failed checks' lines, exit status 2."""

    def __init__(self, command: str, failed: list[Check]) -> None:
        lines = (f"rlship {command}: {check.detail}; {check.fix}" for check in failed)
        print("\n".join(lines), file=sys.stderr, flush=True)
        super().__init__(2)


def require(command: str, checks: Iterable[Check]) -> list[Check]:
    """The checks, or ChecksFailed naming every fatal failure among them."""
    checks = list(checks)
    failed = [check for check in checks if not check.ok and check.fatal]
    if failed:
        raise ChecksFailed(command, failed)
    return checks


# -- Redis --------------------------------------------------------------------------------


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


def run_id_free(client: redis.Redis, run_id: str) -> Check:
    """A run id already used: finished runs are refused, interrupted ones resumed (and said so)."""
    state = RunKeys(run_id)
    finished, next_step = client.mget(state.finished, state.next_step)
    records = client.hlen(state.published)
    if finished is not None:
        return Check(
            "run id",
            False,
            f"run id {run_id!r} was used by a run that finished ({records} records; its keys expire)",
            "choose another --run-id (or leave it out for a fresh one)",
        )
    if next_step is not None or records:
        return Check("run id", True, f"run {run_id!r} exists unfinished ({records} records): it resumes")
    return Check("run id", True, f"run id {run_id!r} is new")


# -- this machine -------------------------------------------------------------------------


def _bind_error(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound now, or None."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return str(exc.strerror or exc)
    return None


def port_pair_free(host: str, port: int) -> Check:
    """The ZMQ sender binds `port` and `port + 1` (READY): both must be free on `host`."""
    for candidate in (port, port + 1):
        if (error := _bind_error(host, candidate)) is not None:
            role = "zmq_port" if candidate == port else "zmq_port + 1 (trainers' READY)"
            held = f"; held by {holder}" if (holder := port_holder(candidate)) else ""
            return Check(
                "ports",
                False,
                f"{role} {host}:{candidate} cannot be bound ({error}{held})",
                "stop what holds it or choose another --zmq-port (it needs the port after it too)",
            )
    return Check("ports", True, f"{host}:{port} and {port + 1} are free for the ZMQ sender")


def ports_of_live_runs(client: redis.Redis) -> Check:
    """The ZMQ ports the live runs of this Redis hold (transport.port_claims)."""
    by_run: dict[tuple[str, str], list[int]] = {}
    for claim in port_claims(client):
        by_run.setdefault((claim.run_id, claim.host), []).append(claim.port)
    held = "; ".join(
        f"run {run_id} on {host}: {', '.join(map(str, ports))}"
        for (run_id, host), ports in sorted(by_run.items())
    )
    return Check("run ports", True, f"ZMQ ports held by live runs of this Redis: {held or 'none'}")


def ports_unclaimed(client: redis.Redis, settings: RunSettings) -> Check:
    """No other live run of this Redis holds the run's ZMQ port pair."""
    holders = other_claimants(client, settings.run_id, settings.zmq_host, settings.zmq_port)
    address = f"zmq_port {settings.zmq_host}:{settings.zmq_port} (or the READY port {settings.zmq_port + 1})"
    if holders:
        return Check(
            "ports",
            False,
            f"{address} is held by live run {', '.join(holders)} of this Redis",
            "choose another --zmq-port (or leave it unset: `rlship run` then takes a free pair)",
        )
    return Check("ports", True, f"{address} is held by no other live run of this Redis")


def metrics_port_free(host: str, port: int) -> Check:
    """The orchestrator's Prometheus endpoint (`metrics_port`) binds `host:port`."""
    if (error := _bind_error(host, port)) is not None:
        return Check(
            "metrics port",
            False,
            f"metrics_port {host}:{port} cannot be bound ({error})",
            "stop what holds it, choose another --metrics-port, or 0 to serve no metrics",
        )
    return Check("metrics port", True, f"{host}:{port} is free for the Prometheus endpoint")


def output_dir_writable(path: Path, *, create: bool = True) -> Check:
    """The run can write its files under `path`; `create=False` (`rlship doctor`) makes
    nothing: the directory, or the nearest one above it that exists, must let it."""
    if not create:
        existing = next(p for p in [path, *path.parents] if p.exists())
        try:
            with tempfile.TemporaryDirectory(dir=existing, prefix=".rlship-check-"):
                pass  # made and removed: what the run would make there can be made
        except OSError as exc:
            return Check(
                "output dir",
                False,
                f"output_dir={str(path)!r} cannot be made in {existing} ({exc.strerror or exc})",
                "choose another --output-dir or fix its permissions",
            )
        return Check("output dir", True, f"{path} is writable" if existing == path else f"{path} can be made")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".rlship-check-"):
            pass
    except OSError as exc:
        return Check(
            "output dir",
            False,
            f"output_dir={str(path)!r} is not writable ({exc.strerror or exc})",
            "choose another --output-dir or fix its permissions",
        )
    return Check("output dir", True, f"{path} is writable")


def rank_in_run(rank: int, ranks: int) -> Check:
    if 0 <= rank < ranks:
        return Check("rank", True, f"rank {rank} of {ranks}")
    return Check("rank", False, f"--rank {rank} is not a rank of this run (ranks={ranks}: 0 to {ranks - 1})",
                 "give --rank from 0 to ranks - 1, and --ranks the run's number of ranks")  # fmt: skip


def workers_on_queues(settings: RunSettings) -> list[Check]:
    """Workers answering on the run's queues: any number on `cpu`, exactly one on `ship`."""
    consumers = queue_consumers(settings.redis_url, [settings.cpu_queue, settings.ship_queue])
    checks = []
    wanted = {settings.cpu_queue: "one or more", settings.ship_queue: "exactly one (-c 1)"}
    for queue in wanted:
        workers = consumers[queue]
        ok = bool(workers) and (queue == settings.cpu_queue or len(workers) == 1)
        detail = f"queue {queue!r}: {len(workers)} worker(s) answering {workers if workers else ''}".rstrip()
        fix = f"start {wanted[queue]}: celery -A tasks worker -Q {queue}"
        checks.append(Check("workers", ok, detail, fix + " (`rlship run` starts its own)", fatal=False))
    return checks


def doctor_checks(settings: RunSettings) -> list[Check]:
    """Everything `rlship doctor` looks at, fatal for a run or not."""
    answer = probe_redis(settings.redis_url)
    checks = [answer.check]
    if answer.reason == "unreachable":
        checks.append(redis_can_be_started(settings.redis_url))
    elif answer.client is not None:
        checks += redis_keeps_data(answer.client, settings.allow_eviction, bool(settings.redis_wait_replicas))
        checks += redis_replicas(answer.client, settings)
    if settings.transport == "zmq":
        checks.append(port_pair_free(settings.zmq_host, settings.zmq_port))
    if settings.metrics_port:
        checks.append(metrics_port_free(settings.metrics_host, settings.metrics_port))
    checks.append(output_dir_writable(Path(settings.output_dir), create=False))
    if answer.client is not None:
        checks.append(ports_of_live_runs(answer.client))
        checks += workers_on_queues(settings)
    return checks


# -- what each command needs ----------------------------------------------------------------


def redis_checks(settings: RunSettings, answer: RedisAnswer, *, replicas_fatal: bool = True) -> list[Check]:
    if answer.client is None:
        return [answer.check]
    return [
        answer.check,
        *redis_keeps_data(answer.client, settings.allow_eviction, bool(settings.redis_wait_replicas)),
        *redis_replicas(answer.client, settings, fatal=replicas_fatal),
    ]


def preflight_run(settings: RunSettings, *, port_movable: bool = False) -> list[Check]:
    """`rlship run`: everything it will need on this machine, before it starts anything. A
    ZMQ port it may move (`port_movable`: left at its default, rlship's own trainer ranks)
    is checked when the run claims it instead (commands/run.py, `claim_ship_ports`)."""
    answer = probe_redis(settings.redis_url)
    checks = [output_dir_writable(Path(settings.output_dir))]
    if answer.reason == "unreachable":
        checks.append(redis_can_be_started(settings.redis_url))
    else:
        checks += redis_checks(settings, answer)
    if answer.client is not None:
        checks.append(run_id_free(answer.client, settings.run_id))
    if settings.transport == "zmq" and not port_movable:
        claimed = ports_unclaimed(answer.client, settings) if answer.client is not None else None
        # One line for one taken port: the run holding it, or else what cannot be bound.
        checks.append(
            claimed if claimed and not claimed.ok else port_pair_free(settings.zmq_host, settings.zmq_port)
        )
    if settings.metrics_port:
        checks.append(metrics_port_free(settings.metrics_host, settings.metrics_port))
    return require("run", checks)


def preflight_client(command: str, settings: RunSettings, *, unfinished_run: bool = False) -> redis.Redis:
    """`orchestrate`, `produce`, `trainer`: a Redis that answers (given a few seconds), with
    the password and database right, and (`unfinished_run`, for the orchestrator) a run id
    not used by a finished run; returns the probing client."""
    answer = wait_for_redis(settings.redis_url)
    checks = redis_checks(settings, answer, replicas_fatal=False)
    if answer.client is not None and unfinished_run:
        checks.append(run_id_free(answer.client, settings.run_id))
    require(command, checks)
    assert answer.client is not None
    return answer.client
