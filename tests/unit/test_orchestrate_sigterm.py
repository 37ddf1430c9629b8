"""The orchestrator's SIGTERM is never lost: it stops the run's task from the event loop, so
a signal that arrives while a finalizer runs stops the run all the same (raised from the
handler, as it once was, the interrupt died in the finalizer and the run went on)."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.support.processes import REPO, signal_when

# Nearly all of the loop's time is spent in a finalizer, where a signal then lands.
SCRIPT = """
import asyncio, sys, time
from orchestrator.commands.orchestrate import interrupted_by_sigterm

class SlowToFinalize:
    def __del__(self):
        deadline = time.monotonic() + 0.05
        while time.monotonic() < deadline:
            pass

async def work():
    print("ready", flush=True)
    while True:
        SlowToFinalize()
        await asyncio.sleep(0)

try:
    asyncio.run(interrupted_by_sigterm(work()))
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def sigterm_once_ready(script: str) -> tuple[int, str, str]:
    """Run `script`, SIGTERM it once it prints "ready": its exit code and what it printed
    after (the test fails if it is still running 10 s later)."""
    process = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    ready = lambda: process.stdout.readline() == "ready\n"  # noqa: E731
    stdout, stderr = signal_when(process, "the loop running", ready, signal.SIGTERM, timeout=10)
    return process.returncode, stdout, stderr


def test_a_sigterm_landing_in_a_finalizer_still_stops_the_orchestrator():
    assert sigterm_once_ready(SCRIPT) == (130, "interrupted\n", "")


# A coroutine on the way absorbs the first cancellation, as `asyncio.wait_for` once did.
ABSORBING = """
import asyncio, sys
from orchestrator.commands import orchestrate
orchestrate.CANCEL_AGAIN_SECONDS = 0.2

async def work():
    print("ready", flush=True)
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        print("absorbed", flush=True)
    await asyncio.sleep(60)

try:
    asyncio.run(orchestrate.interrupted_by_sigterm(work()))
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_a_sigterm_whose_cancellation_is_absorbed_still_stops_the_orchestrator():
    assert sigterm_once_ready(ABSORBING) == (130, "absorbed\ninterrupted\n", "")
