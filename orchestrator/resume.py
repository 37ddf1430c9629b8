"""A run's settings belong to the run: its orchestrator stores them in Redis when it starts,
and a resumed run takes them again. A setting given again on resume may change only what
is safe for the steps already cut and shipped (`CHANGEABLE_ON_RESUME`: how long to run, how
to watch and where to log, the workers' sizes); any other difference stops the resume
naming the setting, its value in the run and the value given. `rlship run` also refuses a
resume whose `steps` would end the run at or before the steps already shipped."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from orchestrator.settings import RunSettings
from transport.keys import RunKeys

CHANGEABLE_ON_RESUME = frozenset(
    {
        "steps", "seed", "redis_wait_replicas", "redis_wait_timeout_ms", "zmq_host", "zmq_port",
        "cpu_workers", "cpu_worker_max_memory_mib",
        "cpu_queue", "ship_queue", "bind_wait_seconds", "samples_per_step", "wandb_project",
        "wandb_mode", "record_rollouts", "max_outstanding_rollouts", "max_held_bytes", "log_json",
        "replay_steps", "max_empty_steps", "stall_seconds", "ack_timeout", "rank_timeout", "allow_eviction",
        "metrics_port", "metrics_host",
    }
)  # fmt: skip
# How this start reached Redis, which may hold a password: never stored.
NOT_STORED = frozenset({"redis_url"})


class ResumeRefused(ValueError):
    """A resume that would change what the run's steps so far were made with, or end it
    before what it has shipped."""


def stored_form(settings: RunSettings) -> str:
    """The settings as the run keeps them: JSON, the derived ones left to derive again."""
    return json.dumps(
        settings.model_dump(mode="json", exclude=settings.derived() | NOT_STORED), sort_keys=True
    )


@dataclass(frozen=True)
class StoredRun:
    """A run as Redis holds it, for the commands that name it (`run`, `config show`, `doctor`)."""

    settings: str  # `stored_form`
    finished: bool
    running: bool  # an orchestrator of it holds its lease
    shipped: int

    @classmethod
    def read(cls, client: redis.Redis, run_id: str) -> StoredRun | None:
        """The run, or None when Redis holds no settings of it (no orchestrator of it started)."""
        keys = RunKeys(run_id)
        pipe = client.pipeline(transaction=False)
        pipe.get(keys.settings).exists(keys.finished).exists(keys.orchestrator_lease).hlen(keys.published)
        stored, finished, running, shipped = pipe.execute()
        return None if stored is None else cls(stored.decode(), bool(finished), bool(running), int(shipped))

    def state(self) -> str:
        """Where it stands, in a few words."""
        state = "finished" if self.finished else "running" if self.running else "stopped"
        return f"{state}, {self.shipped} of {json.loads(self.settings)['steps']} steps shipped"


def given_again(sources: Mapping[str, str]) -> set[str]:
    """The settings a command was given (by any source but the default), the run id aside:
    what `resumed` applies on top of the run's own."""
    return {name for name, source in sources.items() if source != "default"} - {"run_id"}


def resumed(stored: str, settings: RunSettings, given: Collection[str]) -> tuple[RunSettings, dict[str, str]]:
    """The run's stored settings with the `given` ones (set again for this start) applied,
    and the changes, by name, as `old -> new`. Raises ResumeRefused naming every given setting
    that differs from the run's and may not change (compared as resolved: a derived value
    of the run counts, a relative path is taken from here)."""
    kept: dict[str, Any] = json.loads(stored)
    was = comparable(RunSettings.model_validate({**kept, "redis_url": settings.redis_url}))
    now = comparable(settings)
    changed = [name for name in sorted(given) if name not in NOT_STORED and now[name] != was[name]]
    refused = [name for name in changed if name not in CHANGEABLE_ON_RESUME]
    if refused:
        differences = "; ".join(f"{name}: {was[name]!r} in the run, {now[name]!r} given" for name in refused)
        raise ResumeRefused(
            f"run {settings.run_id} was started with other settings ({differences}): a resumed run "
            "keeps them; leave them out to resume, or start a new run"
        )
    given_values = settings.model_dump(mode="json", include=set(changed))
    values = {**kept, **given_values, "redis_url": settings.redis_url}
    return RunSettings.model_validate(values), {n: f"{was[n]!r} -> {now[n]!r}" for n in changed}


def comparable(settings: RunSettings) -> dict[str, Any]:
    """Every setting's value as JSON, paths made absolute."""
    values = settings.model_dump(mode="json")
    for name in values:
        if isinstance(getattr(settings, name), Path):
            values[name] = str(Path(values[name]).resolve())
    return values


def check_steps_left(settings: RunSettings, shipped: int) -> None:
    """A resume must have a step left to ship."""
    if settings.steps <= shipped:
        raise ResumeRefused(
            f"run {settings.run_id} has shipped {shipped} steps; steps={settings.steps} would end it at or "
            f"before them: give --steps above {shipped}"
        )
