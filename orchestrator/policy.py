"""The trainers' policy version now, from the source the run names.

Sources: rlship's own acknowledgement in Redis (`keys.policy_version`, raised by
`rlship trainer` once every rank has a step), and prime-rl's weight-broadcast directory (a
trainer announces version n by creating `{broadcast_dir}/step_{n}/STABLE`: 0 at start-up,
s after its step s; the version is the highest such n), or both (the highest of the two).
The orchestrator follows the source every `POLL_SECONDS` and mirrors what it knows into
Redis (`keys.known_policy_version`), where producers read it. The directory is scanned in
a thread: a slow or network filesystem must not stall the event loop.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from pathlib import Path

import redis.asyncio as aioredis

from orchestrator.settings import RunSettings
from orchestrator.waits import event_set_within
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys

NO_VERSION = -1  # nothing announced yet: below every version a step can wait for
POLL_SECONDS = 0.05
MIRROR_REFRESH_SECONDS = 60.0  # the mirror's expiry is renewed while the version stands still
STABLE = "STABLE"


def broadcast_version(directory: Path) -> int:
    """The highest n for which `directory/step_{n}/STABLE` exists, as prime-rl's
    orchestrator reads it; NO_VERSION without one (or without the directory). A directory
    without STABLE is a broadcast still being written; other names are not broadcasts."""
    best = NO_VERSION
    try:
        entries = os.scandir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return NO_VERSION
    with entries:
        for entry in entries:
            digits = entry.name.removeprefix("step_")
            if digits == entry.name or not (digits.isascii() and digits.isdigit()):
                continue
            version = int(digits)
            if version > best and os.path.exists(os.path.join(entry.path, STABLE)):
                best = version
    return best


class PolicyVersion:
    """The highest policy version seen from the run's source (it never goes back: a
    trainer that prunes old broadcasts does not undo its progress)."""

    def __init__(self, settings: RunSettings, client: aioredis.Redis) -> None:
        assert settings.policy_source is not None and settings.broadcast_dir is not None  # derived
        self.source = settings.policy_source
        self.directory = Path(settings.broadcast_dir)
        self.client = client
        self.keys = RunKeys(settings.run_id)
        self.version = NO_VERSION
        self._moved = asyncio.Event()
        self._mirrored_at = -math.inf

    def describe(self) -> str:
        """The source as the gate's reports name it."""
        broadcasts = f"broadcasts {self.directory}"
        acknowledgements = f"redis {self.keys.policy_version}"
        return {"broadcasts": broadcasts, "redis": acknowledgements}.get(
            self.source, f"{broadcasts} and {acknowledgements}"
        )

    async def read(self) -> int:
        """The version the source says now. rlship's trainers start from version 0."""
        versions = []
        if self.source in ("redis", "both"):
            versions.append(int(await self.client.get(self.keys.policy_version) or 0))
        if self.source in ("broadcasts", "both"):
            versions.append(await asyncio.to_thread(broadcast_version, self.directory))
        return max(versions)

    async def update(self) -> int:
        """Read the source once; on progress wake the waiters, and mirror the version."""
        version = await self.read()
        moved = version > self.version
        if moved:
            self.version = version
            self._moved.set()
            self._moved = asyncio.Event()
        if moved or time.monotonic() - self._mirrored_at >= MIRROR_REFRESH_SECONDS:
            await self.client.set(self.keys.known_policy_version, self.version, ex=DEFAULT_TTL_SECONDS)
            self._mirrored_at = time.monotonic()
        return self.version

    async def follow(self, stopping: asyncio.Event) -> None:
        """Until `stopping`: read the source every POLL_SECONDS."""
        while not stopping.is_set():
            await self.update()
            await event_set_within(stopping, POLL_SECONDS)

    async def moved(self, timeout: float) -> None:
        """Until the version moves, or `timeout` seconds."""
        await event_set_within(self._moved, timeout)
