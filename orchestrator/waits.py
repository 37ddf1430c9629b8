"""Waiting on the orchestrator's event loop for an event, at most some seconds, without
losing a cancellation of the waiting task.

Not `asyncio.wait_for(event.wait(), seconds)`: in Python 3.11 it returns normally when its
task is cancelled just as the event is set (its inner task done, its waiter cancelled), and
that cancellation is gone. A task awaited by another absorbs its awaiter's cancellation that
way: the release follower did, when `drain` set the event it waits on and a SIGTERM's
cancellation arrived in the same turn of the loop, and the orchestrator ran on with its
workers gone. `asyncio.timeout` cancels only on its own deadline and tells its cancellation
from others'.
"""

from __future__ import annotations

import asyncio
import contextlib


async def event_set_within(event: asyncio.Event, seconds: float) -> bool:
    """Wait until `event` is set or `seconds` have passed: whether it is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()
