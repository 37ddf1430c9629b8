"""The orchestrator's one thread for blocking broker and Redis calls.

Celery's `apply_async` blocks on the broker, and packing a cut of 16k rollouts into one
transaction takes tens of milliseconds: both run here, off the event loop, in order.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import redis

from orchestrator.settings import RunSettings
from transport.connection import connect_redis

T = TypeVar("T")


class Publisher:
    def __init__(self, settings: RunSettings) -> None:
        self.run_id = settings.run_id
        self.queue = settings.cpu_queue
        # The thread's own client: redis-py clients are not shared across threads.
        self.client: redis.Redis = connect_redis(settings.redis_url)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlship-publisher")

    async def call(self, work: Callable[[], T]) -> T:
        """Run `work` on the publisher thread, after everything handed to it before."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    async def enqueue(self, task: Any, *args: Any) -> None:
        """Enqueue a task of the run (a stage's: the step first) on the compute queue."""
        await self.call(functools.partial(task.apply_async, (self.run_id, *args), queue=self.queue))

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.client.close()
