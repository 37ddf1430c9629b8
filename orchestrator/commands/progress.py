"""Live progress of `rlship run` (and `rlship status`), drawn from a `StatusReader`.

The supervisor, not the orchestrator, draws it: a display inside the event loop would add
the very lag it reports. In a terminal a few lines are redrawn in place below the per-step
lines; elsewhere (a pipe, a file, CI) the step lines are plain and a status line follows
every few seconds.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from typing import TextIO

import redis

from orchestrator.follower import format_step_line
from orchestrator.settings import queue_label
from orchestrator.status_reader import STAGES, Snapshot, StatusReader, in_flight

REFRESH_SECONDS = 0.25
PLAIN_STATUS_SECONDS = 5.0
BAR_WIDTH = 20


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
    queued = " ".join(f"{queue_label(name)} {length}" for name, length in snapshot.queued.items())
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

    def update(self, status: bool = False, elapsed: float | None = None) -> None:
        """One refresh; with `status`, the status is printed outside a terminal too (the
        first and the last frame); `elapsed`, the run's time to show instead of the clock's (an
        ended run's, as its summary says it). A Redis error skips it: the display must not
        stop the run it shows."""
        try:
            records = self.reader.new_records()
            snapshot = self.reader.snapshot()
        except redis.RedisError:
            return
        new_lines = [format_step_line(record) for record in records]
        now = time.monotonic()
        self._lag_peak_ms = max(
            [
                self._lag_peak_ms,
                snapshot.status.get("loop_lag_max_ms", 0.0),
                snapshot.status.get("loop_lag_peak_ms", 0.0),
            ]
            + [record.get("event_loop_lag/max_ms", 0.0) for record in records]
        )
        shown = now - self.started if elapsed is None else elapsed
        block = status_lines(snapshot, self.total_steps, self.ranks, shown, self._lag_peak_ms)
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
