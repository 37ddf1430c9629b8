"""Why a step makes no progress, in one line, within seconds.

The stall watchdog (`StallWatchdog.watch`, orchestrator.watchdog) asks after `DIAGNOSE_SECONDS`
without progress; the answer comes from what the ship worker reported (a port it cannot
bind, a trainer rank that has not announced READY), from Redis (out of memory), and from
the workers themselves (a queue no worker consumes). Runs on a thread: it makes blocking
calls (Celery's inspect, a sync Redis client) that must stay off the event loop.
"""

from __future__ import annotations

import redis

from orchestrator.settings import RunSettings
from orchestrator.worker_queries import queue_consumers
from transport.keys import RunKeys

DIAGNOSE_SECONDS = 3.0
# Past this share of maxmemory a noeviction Redis refuses the step's next large write.
OUT_OF_MEMORY_SHARE = 0.95


class RedisOutOfMemory(RuntimeError):
    """Redis refuses writes: the step cannot go on, and waiting will not free memory."""


def redis_out_of_memory(client: redis.Redis) -> str | None:
    memory = client.info("memory")
    used, limit = int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0))
    refused = int(client.info("errorstats").get("errorstat_OOM", {}).get("count", 0))
    if limit and (used >= OUT_OF_MEMORY_SHARE * limit or refused):
        return (
            f"Redis is out of memory ({used / 2**20:.0f} MiB used of maxmemory {limit / 2**20:.0f} MiB, "
            f"{refused} writes refused): raise maxmemory or free memory, then resume the run"
        )
    return None


def stall_reason(client: redis.Redis, settings: RunSettings) -> str | None:
    """The first cause found, or None when nothing explains the stall."""
    problem = client.get(RunKeys(settings.run_id).ship_problem)
    if problem:
        return problem.decode()
    out_of_memory = redis_out_of_memory(client)
    if out_of_memory:
        return out_of_memory
    consumers = queue_consumers(settings.redis_url, [settings.cpu_queue, settings.ship_queue])
    for queue, workers in consumers.items():
        if not workers:
            return (
                f"no worker consumes queue {queue!r} ({client.llen(queue)} task(s) waiting): "
                f"start `celery -A tasks worker -Q {queue}`"
            )
    return None
