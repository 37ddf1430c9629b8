"""A run as its orchestrator leaves it in Redis and in its output directory, written by hand
for the commands that read a run (`status`, `config show`, `doctor`): its stored settings
(`orchestrator.resume.stored_form`), start mark, description (`run.json` too), published
steps, and a finished mark or a held lease."""

from __future__ import annotations

import time

import redis

from orchestrator.resume import stored_form
from orchestrator.run_info import RunInfo
from orchestrator.settings import RunSettings
from transport.keys import RunKeys

# Longer than a command's deadline in the tests: a run "running" throughout the test.
HELD_LEASE_SECONDS = 120


def store_run(
    client: redis.Redis,
    settings: RunSettings,
    *,
    shipped: int = 0,
    finished: bool = False,
    running: bool = False,
) -> None:
    """The keys the orchestrator writes for a run that shipped `shipped` steps, and its
    `run.json`; `finished` marks it finished, `running` holds its lease."""
    keys = RunKeys(settings.run_id)
    info = RunInfo.from_settings(settings)
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.settings, stored_form(settings))
    pipe.set(keys.run_marker, time.time())
    pipe.set(keys.info, info.model_dump_json())
    for step in range(shipped):
        pipe.hset(keys.published, step, time.time())
    if finished:
        pipe.set(keys.finished, 1)
    if running:
        pipe.set(keys.orchestrator_lease, "test", ex=HELD_LEASE_SECONDS)
    pipe.execute()
    info.write_beside_outputs()
