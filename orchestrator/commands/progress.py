"""Live progress of `rlship run`, read from Redis by the supervisor.

The supervisor, not the orchestrator, reads it: a display inside the event loop would add
the very lag it reports. Sources: the orchestrator's status hash (written every ingest
turn), the done marks of the steps cut but not yet published, the Celery queue lengths and
the metrics stream. In a terminal a few lines are redrawn in place below the per-step
lines; elsewhere (a pipe, a file, CI) the step lines are plain and a status line follows
every few seconds.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import redis

from tasks.graph import STAGE, STEP_STAGES, Stage, awaited_ranks, predecessors, stage_ranks
from transport.keys import RunKeys, stage_field

STAGES = STEP_STAGES  # shown in flight until the step's record is published
# Steps in flight are bounded by max_async_level; this bounds the reads if that is large.
MAX_STEPS_READ = 16
REFRESH_SECONDS = 0.25
PLAIN_STATUS_SECONDS = 5.0
BAR_WIDTH = 20


# Record times that are not a stage's (wait_for_ckpt: prime-rl's name of the policy wait).
NOT_STAGES = ("time/ship", "time/wait_for_policy", "time/wait_for_ckpt")


def format_step_line(record: dict[str, float]) -> str:
    """The terminal line of a shipped step: its size, reward and where its time went."""
    stages = " ".join(
        f"{name.split('/', 1)[1]} {seconds:.2f}s"
        for name, seconds in sorted(record.items())
        if name.startswith("time/") and name not in NOT_STAGES
    )
    return (
        f"step {int(record['step'])} | rollouts {int(record.get('progress/rollouts', 0))} | "
        f"tokens {int(record.get('progress/tokens', 0)):,} | "
        f"reward {record.get('train/agg/effective/reward/mean', float('nan')):.3f} | {stages} | "
        f"ship {record.get('time/ship', 0.0):.2f}s | "
        f"policy wait {record.get('time/wait_for_policy', 0.0):.2f}s | "
        f"loop lag max {record.get('event_loop_lag/max_ms', 0.0):.1f} ms"
    )


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


def progress_bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    filled = min(width, width * done // total) if total > 0 else 0
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def status_lines(
    snapshot: Snapshot, total_steps: int, ranks: int, elapsed: float, lag_peak_ms: float
) -> list[str]:
    """The status as a few short lines (a terminal redraws them; a log joins them).
    `lag_peak_ms` is the worst loop lag seen so far (in snapshots and records)."""
    status = snapshot.status
    if not status:
        return [f"steps 0/{total_steps} | {elapsed:.1f} s | waiting for the orchestrator's first status"]
    start = int(status.get("start_step", 0))  # the run's steps are numbered from here
    shipped = int(status.get("last_published", start - 1)) + 1 - start
    pending = int(status.get("pending", 0))
    in_groups = int(status.get("in_open_groups", 0))
    counts = in_flight(snapshot.steps, ranks)
    queued = " ".join(f"{name} {length}" for name, length in snapshot.queued.items())
    age = snapshot.now - status.get("updated_at", snapshot.now)
    stalled = ""
    if snapshot.stalled_ranks:
        stalled = f" | policy gate waits on rank(s) {list(snapshot.stalled_ranks)}"
    return [
        f"steps {progress_bar(shipped, total_steps)} {shipped}/{total_steps} shipped, "
        f"{int(status.get('next_step', start)) - start} cut | {elapsed:.1f} s",
        f"rollouts buffered {pending + in_groups} (pending {pending}, in open groups {in_groups}) "
        f"of {int(status.get('arrived', 0))} arrived",
        "in flight " + " ".join(f"{stage} {counts[stage]}" for stage in STAGES) + f" | queued {queued}",
        f"loop lag {status.get('loop_lag_max_ms', 0.0):.1f} ms now, {lag_peak_ms:.1f} ms max "
        f"| status {max(0.0, age):.1f} s old{stalled}",
        *([f"stuck: {snapshot.stall_reason}"] if snapshot.stall_reason else []),
        *([f"held: {snapshot.policy_gate}"] if snapshot.policy_gate else []),
    ]


def redraw(previous_height: int, new_lines: Sequence[str], block: Sequence[str], width: int) -> str:
    """Terminal output that replaces the previous block with `new_lines` (kept, scrolling up)
    and the new block. Block lines are cut to the width: a wrapped line would break the count
    of lines to move up next time."""
    out = [f"\x1b[{previous_height}F\x1b[J"] if previous_height else []
    out.extend(f"{line}\n" for line in new_lines)
    out.extend(f"{line[: max(1, width - 1)]}\n" for line in block)
    return "".join(out)


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


class ProgressDisplay:
    """Prints one line per shipped step and the run's status: redrawn in place in a
    terminal, a plain line every `PLAIN_STATUS_SECONDS` otherwise."""

    def __init__(
        self, reader: StatusReader, stream: TextIO, total_steps: int, ranks: int, elapsed: float = 0.0
    ) -> None:
        """`elapsed`: how long the run has been going already (`rlship status` joins it late)."""
        self.reader = reader
        self.stream = stream
        self.total_steps = total_steps
        self.ranks = ranks
        self.tty = stream.isatty()
        self.started = time.monotonic() - elapsed
        self._height = 0
        self._last_plain = self.started
        self._lag_peak_ms = 0.0

    def update(self, status: bool = False) -> None:
        """One refresh; with `status`, the status is printed outside a terminal too (the
        first and the last frame). A Redis error skips it: the display must not stop the run
        it shows."""
        try:
            records = self.reader.new_records()
            snapshot = self.reader.snapshot()
        except redis.RedisError:
            return
        new_lines = [format_step_line(record) for record in records]
        now = time.monotonic()
        self._lag_peak_ms = max(
            [self._lag_peak_ms, snapshot.status.get("loop_lag_max_ms", 0.0)]
            + [record.get("event_loop_lag/max_ms", 0.0) for record in records]
        )
        block = status_lines(snapshot, self.total_steps, self.ranks, now - self.started, self._lag_peak_ms)
        if self.tty:
            width = shutil.get_terminal_size().columns
            self.stream.write(redraw(self._height, new_lines, block, width))
            self._height = len(block)
        else:
            if status or now - self._last_plain >= PLAIN_STATUS_SECONDS:
                new_lines.append("status: " + " | ".join(block))
                self._last_plain = now
            self.stream.write("".join(f"{line}\n" for line in new_lines))
        self.stream.flush()
