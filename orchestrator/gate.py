"""The policy gate: a step is cut only once the trainers' policy is recent enough.

Step `s` waits for policy version `required_version(s)` (transport.numbering), read from
the run's policy source (orchestrator.policy). While it waits, the gate says every few
seconds what it waits for, in the log and in the run's status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import redis.asyncio as aioredis

from orchestrator.policy import NO_VERSION, PolicyVersion
from orchestrator.settings import RunSettings
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys
from transport.numbering import required_version, step_reaching

log = logging.getLogger("rlship.orchestrator")

POLL_SECONDS = 0.01  # the orchestrator's polling loops sleep this long between looks
STALL_REPORT_SECONDS = 2.0  # a policy wait this long is reported, naming what it waits for
POLICY_REPORT_SECONDS = 5.0  # and again this often while it lasts


class PolicyGate:
    def __init__(
        self, settings: RunSettings, client: aioredis.Redis, policy: PolicyVersion, stopping: asyncio.Event
    ) -> None:
        self.settings = settings
        self.client = client
        self.keys = RunKeys(settings.run_id)
        self.policy = policy
        self.stopping = stopping
        # While the gate holds: the step whose acknowledgement by every rank opens it.
        self.awaited_step: int | None = None

    async def wait(self, step: int) -> float:
        """Hold step `step` until the trainers' policy version (from the run's policy source)
        reaches `required_version`; return the seconds it waited, which the step's manifest
        carries to its record. While held, say every few seconds what it waits for."""
        needed = required_version(step, self.settings.first_step, self.settings.max_async_level)
        if self.policy.version >= needed:
            return 0.0
        started = time.perf_counter()
        next_report = started + STALL_REPORT_SECONDS
        reported = False
        self.awaited_step = step_reaching(needed, self.settings.first_step)
        try:
            while self.policy.version < needed:
                if self.stopping.is_set():
                    return 0.0
                if time.perf_counter() >= next_report:
                    await self._report_wait(step, needed, time.perf_counter() - started)
                    next_report = time.perf_counter() + POLICY_REPORT_SECONDS
                    reported = True
                await self.policy.moved(min(1.0, max(POLL_SECONDS, next_report - time.perf_counter())))
        finally:
            self.awaited_step = None
        if reported:
            await self.client.hdel(self.keys.status, "stalled_ranks", "policy_gate")
            log.warning("step %d: the policy gate opened after %.1f s", step, time.perf_counter() - started)
        return time.perf_counter() - started

    async def _report_wait(self, step: int, needed: int, seconds: float) -> None:
        """Name the source and version the gate waits for and, with rlship's trainers, the
        ranks that have not acknowledged the step that raises it (one stopped reading, or died)."""
        have = "none" if self.policy.version == NO_VERSION else self.policy.version
        held = (
            f"step {step} held by the policy gate: waiting for version {needed} from "
            f"{self.policy.describe()} (have {have}) for {seconds:.1f} s"
        )
        report: dict[str, str] = {}
        if self.settings.trainers == "builtin" and self.policy.source != "broadcasts":
            awaited_step = step_reaching(needed, self.settings.first_step)
            acknowledged = {int(r) for r in await self.client.smembers(self.keys.trained(awaited_step))}
            stalled = sorted(set(range(self.settings.ranks)) - acknowledged)
            report["stalled_ranks"] = json.dumps(stalled)
            held += f"; rank(s) {stalled} have not acknowledged step {awaited_step}"
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.status, mapping={**report, "policy_gate": held})
        pipe.expire(self.keys.status, DEFAULT_TTL_SECONDS)
        await pipe.execute()
        log.warning("%s", held)
