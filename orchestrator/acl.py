"""Least privilege on a shared Redis: the ACL rules of a run's roles (`rlship acl`).

Each role's user may touch only the run's own keys (`rlship:{run}:*`, `transport.keys`),
the Celery queues of the run where the role sends or takes tasks (their lists and kombu's
binding tables of them), and run only the commands the role's code sends, its Lua scripts
(EVALSHA, with their keys declared) included. A process of another run, or one given
another run's key names, gets NOPERM. What kombu shares between every queue of a server
(its table of unacknowledged messages, the control and event channels of Celery's
`inspect` and Flower) is granted to the roles that use it: kombu names it once per server.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import redis.connection

from orchestrator.settings import ROLES, RunSettings
from transport.connection import RedisAddress
from transport.keys import RunKeys, queue_traces, ship_port_claim

# Commands, space-separated. What every role's connection does: redis-py's hello and client
# name, a ping, the checks of its command's start (INFO), scripts by their hash and WAIT.
_COMMON = (
    "ping hello client|setname info evalsha eval script|load script|exists wait multi "
    "exec discard watch unwatch select"
)
_COMMANDS: dict[str, str] = {
    "producer": ("get mget set exists incr incrby hget hgetall hset hmget hincrby xadd ttl expire"),
    "worker": (
        "get getrange mget strlen set setnx getdel del unlink exists expire pexpire ttl time incr incrby "
        "decrby incrbyfloat hget "
        "hgetall hset hsetnx hdel hincrby hincrbyfloat hmget hkeys hlen hexists sadd srem smembers scard "
        "sismember zadd zrem zrange zrangebyscore zscore zcard xadd xrange xlen lpush rpush lpop rpop "
        "brpop llen lrange ltrim publish subscribe psubscribe unsubscribe punsubscribe scan"
    ),
    "orchestrator": (
        "get mget strlen set del unlink exists expire pexpire ttl time incr incrby decrby hget hgetall "
        "hset hdel hexists hincrby "
        "hmget hkeys hlen sadd srem smembers scard zadd zrem zrange zrangebyscore zcard xadd xrange "
        "xrevrange xread xlen xtrim lpush lpop rpush llen lrange ltrim brpop publish subscribe psubscribe "
        "unsubscribe punsubscribe scan"
    ),
    "trainer": (
        "get set exists incr hget hgetall hset hkeys hincrby hincrbyfloat sadd scard smembers rpush lrange "
        "zrange publish expire"
    ),
}
# kombu's keys and channels shared by every queue of a server: its table of unacknowledged
# messages (consumers), Celery's control (`inspect`, a worker's own mailbox, the replies)
# and event channels.
_KOMBU_CONSUMER_KEYS = ("unacked", "unacked_index", "unacked_mutex")
_QUEUE_DEADLINES = "_kombu.binding_deadlines"  # when each expiring queue's bindings go
# kombu keeps a queue's messages of priority N in the list `{queue}\x06\x16{N}`, N one digit.
_PRIORITY_SUFFIX = "??[0-9]"
_CONTROL_KEYS = (
    "_kombu.binding.celery.pidbox",
    "_kombu.binding_permanent.celery.pidbox",
    "_kombu.binding.reply.celery.pidbox",
    "*.reply.celery.pidbox*",
)


@dataclass(frozen=True)
class RoleUser:
    role: str
    name: str
    password: str | None

    def rule(self, keys: list[str], channels: list[str], commands: str) -> str:
        """`ACL SETUSER`: the user reset, its password by hash only (never printed), then
        what it may touch and run."""
        secret = [f"#{hashlib.sha256(self.password.encode()).hexdigest()}"] if self.password else []
        allowed = [f"+{command}" for command in f"{_COMMON} {commands}".split()]
        words = [
            "reset",
            "on",
            *secret,
            *(f"~{key}" for key in keys),
            *(f"&{channel}" for channel in channels),
        ]
        return " ".join(["ACL", "SETUSER", self.name, *words, *allowed])


def role_user(settings: RunSettings, role: str) -> RoleUser:
    """The role's user: the one its `redis_{role}_auth` names, or `rlship.{run}.{role}`
    without a password (to be given one with `ACL SETUSER NAME >PASSWORD`)."""
    auth = getattr(settings, f"redis_{role}_auth")
    if auth:
        name, _, password = auth.partition(":")
        return RoleUser(role, name, password)
    return RoleUser(role, f"rlship.{settings.run_id}.{role}", None)


def role_keys(settings: RunSettings, role: str) -> tuple[list[str], list[str]]:
    """The key and channel patterns of `role` in the run of `settings`."""
    run = RunKeys(settings.run_id)
    keys = [f"{run.prefix}*"]
    channels = [f"{run.prefix}*"]
    queues = [
        key
        for queue in (str(settings.cpu_queue), str(settings.ship_queue))
        for key in (*queue_traces(queue), queue + _PRIORITY_SUFFIX)
    ] + [_QUEUE_DEADLINES]
    # kombu's fanout channels, `/{db}.{exchange}`: Celery's control (subscribed to by name,
    # which ACL matches literally) and events.
    db = _database(settings.redis_url)
    fanout = [f"/{db}.celery.pidbox", f"/{db}.celeryev/*"]
    if role == "worker":
        workers = [f"{kind}-{settings.run_id}@*.celery.pidbox*" for kind in ("cpu", "ship")]
        keys += [*queues, *_KOMBU_CONSUMER_KEYS, *_CONTROL_KEYS, *workers]
        channels += fanout
    elif role == "orchestrator":
        ports = (settings.zmq_port, settings.zmq_port + 1)
        keys += [*queues, *_CONTROL_KEYS, *(ship_port_claim(settings.zmq_host, port) for port in ports)]
        # Its lease renews the expiry of the run's own queues (`RunKeys.own_queue_traces`,
        # named by the run's id alone) whatever queues the run was given: without them, a run
        # on named queues (`cpu_queue`, `ship_queue`) was refused its first renewal and stopped.
        keys += [key for key in run.own_queue_traces if key not in queues]
        channels += fanout
    return keys, channels


def _database(url: str) -> int:
    address = RedisAddress.parse(url)
    return address.db if address.is_sentinel else int(redis.connection.parse_url(url).get("db") or 0)


def acl_rules(settings: RunSettings, roles: tuple[str, ...] = ROLES) -> list[str]:
    """One `ACL SETUSER` line per role of the run (of `roles`)."""
    return [role_user(settings, role).rule(*role_keys(settings, role), _COMMANDS[role]) for role in roles]


def roles_with_users(settings: RunSettings) -> tuple[str, ...]:
    """The roles whose processes connect as a user of their own (`redis_{role}_auth` set)."""
    return tuple(role for role in ROLES if getattr(settings, f"redis_{role}_auth"))
