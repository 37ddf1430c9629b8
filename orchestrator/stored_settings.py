"""A run's stored settings, as a process beside its orchestrator reads them (a producer).

The orchestrator stores the run's settings when it starts (`orchestrator.resume`); a
producer made for the run checks its rollouts against those, not against defaults it was
built with: given the run id alone it takes them (waiting for a run that has not started
yet, if told to), and given settings it refuses any it set that the run does not have.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import redis
import redis.asyncio as aioredis

from orchestrator.resume import CHANGEABLE_ON_RESUME, NOT_STORED, comparable
from orchestrator.settings import RunSettings
from transport.keys import RunKeys

log = logging.getLogger("rlship.producer")

POLL_SECONDS = 0.5


class RunNotStarted(LookupError):
    """No settings of the run in Redis: its orchestrator has not started (or the run's keys
    expired), so a producer cannot know its limits."""


class SettingsDisagree(ValueError):
    """Settings a producer was given that the run was started without."""


def _sentinel_managed(client: Any) -> bool:
    pools = (redis.sentinel.SentinelConnectionPool, aioredis.sentinel.SentinelConnectionPool)
    return isinstance(getattr(client, "connection_pool", None), pools)


def run_settings(stored: str, client: Any, given: RunSettings | None) -> RunSettings:
    """The run's settings from their stored form. A setting `given` sets that the run's
    steps depend on must be the run's (compared as resolved), or `SettingsDisagree` names
    each that is not; one a resume may change (`CHANGEABLE_ON_RESUME`: the backlog, the byte
    budget, how long it runs) is taken as given, since the run being resumed with it has
    not stored it yet. The client's way to Redis is kept (Sentinels wait for a replica)."""
    values = json.loads(stored)
    if given is not None:
        values["redis_url"] = given.redis_url
    run = RunSettings.model_validate(values)
    if given is None:
        if _sentinel_managed(client) and "redis_wait_replicas" not in values:
            run = run.with_changes(redis_wait_replicas=1)
        return run
    was, now = comparable(run), comparable(given)
    differ = [name for name in sorted(given.model_fields_set - NOT_STORED) if was[name] != now[name]]
    refused = [name for name in differ if name not in CHANGEABLE_ON_RESUME]
    if refused:
        listed = "; ".join(f"{name}: {was[name]!r} in the run, {now[name]!r} given" for name in refused)
        raise SettingsDisagree(
            f"run {run.run_id} was started with other settings ({listed}): build the producer "
            f"with the run id alone (for_run(client, {run.run_id!r})) to take the run's"
        )
    return run.with_changes(**{name: getattr(given, name) for name in differ}) if differ else run


def _not_started(run_id: str, waited: float) -> RunNotStarted:
    after = f" after waiting {waited:g} s" if waited else ""
    return RunNotStarted(
        f"run {run_id} has no settings in Redis{after}: its orchestrator stores them when it starts "
        "(`rlship orchestrate --run-id ...`); start it first, or give the producer wait=SECONDS"
    )


def _say_waiting(run_id: str, wait: float) -> None:
    log.warning(
        "run %s has not stored its settings yet; waiting up to %g s for its orchestrator", run_id, wait
    )


def read_run_settings(
    client: redis.Redis, run_id: str, given: RunSettings | None, wait: float
) -> RunSettings:
    """The run's stored settings (`run_settings`), waiting up to `wait` seconds for them.
    Given settings and nothing stored, the given ones stand (a workload written before its
    run starts) unless `wait` says to wait."""
    key = RunKeys(run_id).settings
    deadline = time.monotonic() + wait
    stored = client.get(key)
    if stored is None and wait > 0:
        _say_waiting(run_id, wait)
        while stored is None and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
            stored = client.get(key)
    if stored is None:
        if given is not None:
            return given
        raise _not_started(run_id, wait)
    return run_settings(stored.decode(), client, given)


async def read_run_settings_async(
    client: aioredis.Redis, run_id: str, given: RunSettings | None, wait: float
) -> RunSettings:
    """`read_run_settings` on `redis.asyncio`."""
    key = RunKeys(run_id).settings
    deadline = time.monotonic() + wait
    stored = await client.get(key)
    if stored is None and wait > 0:
        _say_waiting(run_id, wait)
        while stored is None and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
            stored = await client.get(key)
    if stored is None:
        if given is not None:
            return given
        raise _not_started(run_id, wait)
    return run_settings(stored.decode(), client, given)
