"""Follow records: the published step records, as the finalizer writes them to Redis.

Each new record goes to the monitors (metrics.jsonl, W&B; on a thread of their own) and
to the terminal as one line, and its step is handed on (`on_published`: the rollout log,
the dispatcher's room in flight, the step's release). The follower owns the run's
`last_published` step, and stops once the run's last step is published.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis

from orchestrator.ingest import READ_BLOCK_MS
from orchestrator.monitors import Monitors
from orchestrator.settings import RunSettings
from tasks.stages.record_names import agg_statistic, shipped_rollouts, shipped_tokens
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys

RECENT_RECORDS = 8


# Record times that are not a stage's (wait_for_ckpt: prime-rl's name of the policy wait).
NOT_STAGES = ("time/ship", "time/wait_for_policy", "time/wait_for_ckpt")


def format_step_line(record: dict[str, float]) -> str:
    """The terminal line of a shipped step: its size, reward and where its time went."""
    stages = " ".join(
        f"{name.split('/', 1)[1]} {seconds:.2f}s"
        for name, seconds in sorted(record.items())
        if name.startswith("time/") and name not in NOT_STAGES
    )
    reward = record.get(agg_statistic(record, "effective", "reward") + "/mean", float("nan"))
    return (
        f"step {int(record['step'])} | rollouts {int(shipped_rollouts(record))} | "
        f"tokens {int(shipped_tokens(record)):,} | "
        f"reward {reward:.3f} | {stages} | "
        f"ship {record.get('time/ship', 0.0):.2f}s | "
        f"policy wait {record.get('time/wait_for_policy', 0.0):.2f}s | "
        f"loop lag max {record.get('event_loop_lag/max_ms', 0.0):.1f} ms"
    )


class RecordFollower:
    def __init__(
        self,
        settings: RunSettings,
        client: aioredis.Redis,
        stopping: asyncio.Event,
        on_published: Callable[[int], Awaitable[None]],
    ) -> None:
        # Given.
        self.settings = settings
        self.client = client
        self.keys = RunKeys(settings.run_id)
        self.stopping = stopping
        self.on_published = on_published
        self.start_step: int = settings.step_numbers.start
        self.end_step: int = settings.step_numbers.stop
        # Moved on by every record followed (and by `resume`).
        self.last_published = self.start_step - 1
        # The most recent records (the stream holds them all): bounded on a run of any length.
        self.records: deque[dict[str, float]] = deque(maxlen=RECENT_RECORDS)
        self.records_published = 0
        self.tokens_shipped = 0
        # Opened by `open` when the run starts (it creates files, and W&B's run).
        self.monitors: Monitors | None = None
        self._monitor_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlship-monitors")

    def open(self) -> None:
        self.monitors = Monitors(self.settings)

    async def resume(self) -> None:
        """Continue after the last step a previous orchestrator of the run followed."""
        self.last_published = int(await self.client.get(self.keys.followed) or self.start_step - 1)

    async def follow(self) -> None:
        """Mirror published records to metrics.jsonl, print a line each, hand each step on."""
        assert self.monitors is not None, "open() first"
        cursor = "0-0"
        loop = asyncio.get_running_loop()
        while self.last_published < self.end_step - 1 and not self.stopping.is_set():
            response = await self.client.xread(
                {self.keys.metrics_stream: cursor}, count=16, block=READ_BLOCK_MS
            )
            for entry_id, fields in response[0][1] if response else []:
                cursor = entry_id.decode()
                record = json.loads(fields[b"record"])
                step = int(record["step"])
                if step <= self.last_published:
                    continue
                await loop.run_in_executor(self._monitor_thread, self.monitors.log, record)
                print(format_step_line(record), flush=True)
                self.records.append(record)
                self.records_published += 1
                self.tokens_shipped += int(shipped_tokens(record))
                self.last_published = step
                await self.on_published(step)
                await self.client.set(self.keys.followed, step, ex=DEFAULT_TTL_SECONDS)

    def close(self) -> None:
        if self.monitors is not None:
            self._monitor_thread.submit(self.monitors.close).result()
        self._monitor_thread.shutdown(wait=True)
