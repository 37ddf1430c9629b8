"""Redis clients that ride out a Redis restart.

Every long-lived process (orchestrator, workers, trainer ranks, producer) gets its clients
here, so they share one policy: a command that fails on a lost connection is retried with
backoff for about `OUTAGE_SECONDS`, long enough for a restart, short enough that a Redis
that stays down ends the process with a clear error instead of a hang.

Retrying is safe for rlship's writes: they are idempotent (SET, HSET, SADD, marks), guarded
(the record is written in a WATCH transaction, which redis-py does not replay: the
WatchError sends the publisher round its check again), or counters whose rare double count
after a lost reply costs only a statistic.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

OUTAGE_SECONDS = 30.0
_BACKOFF = {"cap": 1.0, "base": 0.05}
# 0.05, 0.1, ... capped at 1 s: about OUTAGE_SECONDS in all.
_RETRIES = 5 + int(OUTAGE_SECONDS)


def connect_redis(url: str, **options: Any) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(**_BACKOFF), _RETRIES),
        retry_on_error=[ConnectionError, TimeoutError],
        **options,
    )


def connect_redis_async(url: str, **options: Any) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        retry=AsyncRetry(ExponentialBackoff(**_BACKOFF), _RETRIES),
        retry_on_error=[ConnectionError, TimeoutError],
        **options,
    )
