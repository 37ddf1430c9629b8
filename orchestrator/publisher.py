"""The orchestrator's one thread for blocking broker and Redis calls.

Celery's `apply_async` blocks on the broker, and packing a cut of 16k rollouts into one
transaction takes tens of milliseconds: both run here, off the event loop, in order. A
step's tasks are enqueued in its trace (`enqueue_step`: the step's root span, held by the
publisher's `StepTraces`, as the parent they carry).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import redis

from orchestrator.settings import RunSettings
from orchestrator.step_traces import StepTraces
from transport.connection import connect_redis

T = TypeVar("T")


class Publisher:
    def __init__(self, settings: RunSettings) -> None:
        self.run_id = settings.run_id
        self.queue = settings.cpu_queue
        # The thread's own client: redis-py clients are not shared across threads.
        self.client: redis.Redis = connect_redis(settings.redis_url)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlship-publisher")
        self.traces = StepTraces(settings.run_id)

    async def call(self, work: Callable[[], T]) -> T:
        """Run `work` on the publisher thread, after everything handed to it before."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    async def enqueue(self, task: Any, *args: Any, headers: Mapping[str, str] | None = None) -> None:
        """Enqueue a task of the run on the compute queue (`headers`: its message's own)."""
        send = functools.partial(task.apply_async, (self.run_id, *args), queue=self.queue)
        await self.call(functools.partial(send, headers=dict(headers)) if headers else send)

    async def enqueue_step(self, task: Any, step: int, *args: Any) -> None:
        """Enqueue a stage task of step `step`, in the step's trace."""
        await self.enqueue(task, step, *args, headers=self.traces.headers(step))

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.client.close()
