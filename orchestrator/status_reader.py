"""A run's state as read from Redis, for whoever shows it from outside the event loop.

`StatusReader` takes a `Snapshot`: the orchestrator's status hash (written every ingest
turn), the done marks and sent ranks of the steps cut but not yet published, the Celery
queue lengths; and the records published since the last read. `rlship run`'s display,
`rlship status` and the Prometheus exporter read it; the orchestrator never does (a reader
inside the event loop would add the very lag it reports).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from tasks.graph import STAGE, STEP_STAGES, Stage, awaited_ranks, predecessors, stage_ranks
from transport.keys import RunKeys, stage_field

STAGES = STEP_STAGES  # shown in flight until the step's record is published
# Steps in flight are bounded by max_async_level; this bounds the reads if that is large.
MAX_STEPS_READ = 16


@dataclass(frozen=True)
class StepMarks:
    """What the workers have finished of one step: `done:{stage}` marks and ranks sent."""

    step: int
    done: frozenset[str]
    sent: frozenset[int]

    def has_done(self, stage: Stage, rank: int | None) -> bool:
        """Whether the stage (of that rank) is done: its mark, or for send its rank sent;
        publish never is (the step would not be read)."""
        if stage.marked:
            return stage_field(stage.name, rank) in self.done
        return stage.per_rank and rank in self.sent


@dataclass(frozen=True)
class Snapshot:
    status: dict[str, float]  # the orchestrator's status hash; empty until its first write
    steps: tuple[StepMarks, ...]  # steps cut and not yet published, in order
    queued: dict[str, int]  # Celery queue -> messages waiting
    now: float  # unix time of the read
    stalled_ranks: tuple[int, ...] = ()  # ranks the policy gate has waited on for seconds
    stall_reason: str = ""  # why a step makes no progress, from the orchestrator's watchdog
    policy_gate: str = ""  # what the policy gate holds a step for (source, version)


def parse_status(raw: dict[bytes, bytes]) -> tuple[dict[str, float], tuple[int, ...]]:
    """The status hash: numeric fields, and `stalled_ranks` (a JSON list) apart; the text
    `stall_reason` and `policy_gate` are read on their own."""
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    stalled = tuple(json.loads(fields.pop("stalled_ranks", "[]")))
    fields.pop("stall_reason", None)
    fields.pop("policy_gate", None)
    return {k: float(v) for k, v in fields.items()}, stalled


def in_flight(steps: Sequence[StepMarks], ranks: int) -> Counter[str]:
    """Tasks per stage that are queued or running (`tasks.graph`): they are not done, and
    what they follow is (for the same rank, or every rank before a per-step stage)."""
    counts: Counter[str] = Counter({stage: 0 for stage in STAGES})
    for marks in steps:
        for stage in (STAGE[name] for name in STAGES):
            for rank in stage_ranks(stage, ranks):
                inputs_done = all(
                    marks.has_done(before, each)
                    for before in predecessors(stage.name)
                    for each in awaited_ranks(before, stage, rank, ranks)
                )
                counts[stage.name] += int(inputs_done and not marks.has_done(stage, rank))
    return counts


class StatusReader:
    """Reads a run's progress from Redis: two pipelined round trips per snapshot."""

    def __init__(self, client: redis.Redis, run_id: str, queues: Sequence[str], ranks: int) -> None:
        self.client = client
        self.keys = RunKeys(run_id)
        self.queues = list(queues)
        self.ranks = ranks
        # Only records published from now on: a resumed run's old records were shown before.
        last = client.xrevrange(self.keys.metrics_stream, count=1)
        self._cursor = last[0][0].decode() if last else "0-0"
        self._last_record_step = int(last[0][1][b"step"]) if last else -1

    def snapshot(self) -> Snapshot:
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.keys.status)
        for queue in self.queues:
            pipe.llen(queue)
        raw_status, *lengths = pipe.execute()
        status, stalled = parse_status(raw_status)
        if status:
            # The orchestrator stops writing its status once it has read the last record.
            status["last_published"] = max(status.get("last_published", -1), self._last_record_step)
        first = int(status.get("last_published", -1)) + 1
        steps = range(first, min(int(status.get("next_step", 0)), first + MAX_STEPS_READ))
        marked = [
            (stage.name, rank)
            for stage in (STAGE[name] for name in STAGES)
            if stage.marked
            for rank in stage_ranks(stage, self.ranks)
        ]
        stages = [stage_field(stage, rank) for stage, rank in marked]
        for step in steps:
            for stage, rank in marked:
                pipe.exists(self.keys.done(step, stage, rank))
            pipe.smembers(self.keys.sent(step))
        replies = pipe.execute() if steps else []
        marks = []
        for i, step in enumerate(steps):
            *exists, sent = replies[i * (len(stages) + 1) : (i + 1) * (len(stages) + 1)]
            marks.append(
                StepMarks(
                    step,
                    frozenset(s for s, e in zip(stages, exists, strict=True) if e),
                    frozenset(int(r) for r in sent),
                )
            )
        queued = dict(zip(self.queues, lengths, strict=True))
        reason = raw_status.get(b"stall_reason", b"").decode()
        held = raw_status.get(b"policy_gate", b"").decode()
        return Snapshot(status, tuple(marks), queued, time.time(), stalled, reason, held)

    def new_records(self) -> list[dict[str, float]]:
        """Records published since the previous call."""
        response = self.client.xread({self.keys.metrics_stream: self._cursor}, count=256)
        entries = response[0][1] if response else []
        if entries:
            self._cursor = entries[-1][0].decode()
        records = [json.loads(fields[b"record"]) for _id, fields in entries]
        self._last_record_step = max([self._last_record_step, *(int(r["step"]) for r in records)])
        return records
