"""Fault injection, for the fault tests and `rlship chaos`: a worker started with
`RLSHIP_FAULTS=1` kills its own process (SIGKILL, as the OOM killer would) in the middle
of a stage that a test has armed in Redis, once. Elsewhere this is a no-op costing
nothing: the environment is read once per process.

Armed faults live in the run's hash `RunKeys.faults`, field `{stage}:{step}` or
`{stage}:{step}:{rank}`. The field is deleted before the kill, so the redelivered task
runs clean; a test sees that the fault fired when the field is gone.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable

import redis

from transport.keys import RunKeys
from transport.store import DEFAULT_TTL_SECONDS

FAULTS_ENV = "RLSHIP_FAULTS"


@functools.cache
def enabled() -> bool:
    return os.environ.get(FAULTS_ENV) == "1"


def fault_field(stage: str, step: int, rank: int | None = None) -> str:
    return f"{stage}:{step}" if rank is None else f"{stage}:{step}:{rank}"


def arm(client: redis.Redis, run_id: str, stage: str, step: int, rank: int | None = None) -> None:
    faults = RunKeys(run_id).faults
    pipe = client.pipeline(transaction=True)
    pipe.hset(faults, fault_field(stage, step, rank), 1)
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
    """Die here, now, if this stage of this step (and rank) is armed; `before` first, to make
    the moment what the fault names (a send's bytes flushed out of the process, say)."""
    if enabled() and client.hdel(RunKeys(run_id).faults, fault_field(stage, step, rank)):
        if before is not None:
            before()
        os.kill(os.getpid(), signal.SIGKILL)
