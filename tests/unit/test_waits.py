"""`event_set_within` never loses a cancellation of the task that waits, even one that
arrives in the turn of the loop where the event is set; `asyncio.wait_for` (Python 3.11) does,
which is how a SIGTERM once left the orchestrator running with its workers gone."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

import pytest

from orchestrator.waits import event_set_within

Wait = Callable[[asyncio.Event, float], Awaitable[object]]


async def wait_for_event(event: asyncio.Event, seconds: float) -> None:
    """The form the orchestrator used before."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


async def went_on_after_cancel(wait: Wait, turns: int) -> bool:
    """The release follower's shape: a task waits on an event; another sets it and awaits
    that task; a third cancels the second `turns` turns of the loop later. Whether the
    cancelled task went on as if it had not been cancelled."""
    event = asyncio.Event()

    async def follower() -> None:
        while not event.is_set():
            await wait(event, 60)

    following = asyncio.create_task(follower())

    async def drain() -> None:
        await asyncio.sleep(0)  # the follower is waiting
        event.set()
        await following
        await asyncio.sleep(60)  # reached only by a task whose cancellation was lost

    draining = asyncio.create_task(drain())
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the event is set now
    for _ in range(turns):
        await asyncio.sleep(0)
    draining.cancel()
    try:
        await asyncio.wait_for(asyncio.shield(draining), 1.0)
    except asyncio.CancelledError:
        return False
    except TimeoutError:
        draining.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await draining
        return True
    raise AssertionError("drain cannot end on its own")


@pytest.mark.parametrize("turns", range(4))
def test_a_cancellation_as_the_event_is_set_is_never_lost(turns):
    assert not asyncio.run(went_on_after_cancel(event_set_within, turns))


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12's wait_for keeps the cancellation")
def test_the_scenario_reaches_the_race_wait_for_loses():
    """The control: the same scenario loses the cancellation with `asyncio.wait_for` at one
    of the turns, so the test above looks where the race is."""
    assert any(asyncio.run(went_on_after_cancel(wait_for_event, turns)) for turns in range(4))


def test_it_says_whether_the_event_was_set():
    async def both() -> tuple[bool, bool]:
        event = asyncio.Event()
        timed_out = await event_set_within(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        return timed_out, await event_set_within(event, 5)

    assert asyncio.run(both()) == (False, True)
