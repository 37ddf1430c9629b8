"""Fault injection, for the fault tests and `rlship chaos`: a worker started with
`RLSHIP_FAULTS=1` kills its own process (SIGKILL, as the OOM killer would) in the middle
of a stage that a test has armed in Redis, once. Elsewhere this is a no-op costing
nothing: the environment is read once per process.

Armed faults live in the run's hash `RunKeys.faults`, field `{stage}:{step}` or
`{stage}:{step}:{rank}`, value how: `kill` (the default), or `raise` (the task raises
`InjectedFault` instead: a task that fails, not a worker that dies). The field is deleted
before the fault, so the next delivery runs clean; a test sees that the fault fired when
the field is gone.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable

import redis

from transport.keys import DEFAULT_TTL_SECONDS, RunKeys

FAULTS_ENV = "RLSHIP_FAULTS"


@functools.cache
def enabled() -> bool:
    return os.environ.get(FAULTS_ENV) == "1"


def fault_field(stage: str, step: int, rank: int | None = None) -> str:
    return f"{stage}:{step}" if rank is None else f"{stage}:{step}:{rank}"


KILL, RAISE = "kill", "raise"


class InjectedFault(RuntimeError):
    """The exception a fault armed to `raise` raises."""


def arm(
    client: redis.Redis, run_id: str, stage: str, step: int, rank: int | None = None, how: str = KILL
) -> None:
    if how not in (KILL, RAISE):
        raise ValueError(f"how: {how!r} is not one of {KILL!r}, {RAISE!r}")
    faults = RunKeys(run_id).faults
    pipe = client.pipeline(transaction=True)
    pipe.hset(faults, fault_field(stage, step, rank), how)
    pipe.expire(faults, DEFAULT_TTL_SECONDS)
    pipe.execute()


def crash_if_armed(
    client: redis.Redis,
    run_id: str,
    stage: str,
    step: int,
    rank: int | None = None,
    before: Callable[[], None] | None = None,
) -> None:
    """Die (or raise) here, now, if this stage of this step (and rank) is armed; before a
    kill, `before`, to make the moment what the fault names (a send's bytes flushed out of
    the process, say)."""
    if not enabled():
        return
    faults, field = RunKeys(run_id).faults, fault_field(stage, step, rank)
    pipe = client.pipeline(transaction=True)
    pipe.hget(faults, field)
    pipe.hdel(faults, field)
    how, _ = pipe.execute()
    if how == RAISE.encode():
        raise InjectedFault(f"{field}: a fault armed to raise")
    if how is not None:
        if before is not None:
            before()
        os.kill(os.getpid(), signal.SIGKILL)
