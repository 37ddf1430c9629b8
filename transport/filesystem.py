"""Filesystem step transport (docs/transports.md, "Filesystem"), for trainers that share a
directory with the ship workers instead of a network path.

Layout: `{output_dir}/rollouts/step_{step}/rank_{rank}.bin`. A payload is written to a
hidden temporary name in the same directory and then renamed over the final name, so a
reader that sees `rank_{rank}.bin` sees the whole file (rename is atomic within a
filesystem). A repeated send of a step replaces the file with identical bytes.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from transport.base import Closeable, Payload, ReceivedStep, SequencedReceiver, StepSequencer


def step_dir(output_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(output_dir) / "rollouts" / f"step_{step}"


def payload_path(output_dir: str | os.PathLike[str], step: int, rank: int) -> Path:
    return step_dir(output_dir, step) / f"rank_{rank}.bin"


class FileSender(Closeable):
    """Writes each (step, rank) payload atomically. `fsync=True` also makes the bytes durable
    before the rename (a crash cannot leave a complete-looking but empty file); it is off by
    default because the readers are live processes, not crash recovery."""

    def __init__(self, output_dir: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.output_dir = Path(output_dir)
        self.fsync = fsync
        self._closed = False

    def send(self, step: int, rank: int, payload: Payload) -> None:
        if self._closed:
            raise RuntimeError("FileSender is closed")
        if step < 0 or rank < 0:
            raise ValueError(f"step and rank must be >= 0, got step {step}, rank {rank}")
        final = payload_path(self.output_dir, step, rank)
        final.parent.mkdir(parents=True, exist_ok=True)
        # Unique per writer, so two workers sending the same step never share a temp file;
        # the name does not end in `.bin`, so globbing readers never pick it up.
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def close(self) -> None:
        self._closed = True


class FileReceiver(SequencedReceiver):
    """Reads one rank's payloads in step order by polling for the file of `next_step`.

    Unlike the ZMQ receiver, this one asks for a step by name, so it never sees duplicates
    and never reports a gap: if step 5 exists while step 4 does not, it keeps waiting for
    step 4 (a step written out of order by a redelivered task is still in time). Files are
    left in place; cleaning them up is the run's business.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        rank: int,
        *,
        next_step: int,
        poll_interval: float = 0.01,
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.output_dir = Path(output_dir)
        self.poll_interval = poll_interval
        self._sequencer = StepSequencer(rank, next_step)
        self._closed = False

    def receive(self, timeout: float | None = None) -> ReceivedStep | None:
        """The payload of `next_step`, or None if its file does not appear within `timeout`."""
        if self._closed:
            raise RuntimeError("FileReceiver is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        step = self.next_step
        path = payload_path(self.output_dir, step, self.rank)
        while True:
            try:
                payload = path.read_bytes()
            except FileNotFoundError:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return None
                wait = self.poll_interval if deadline is None else min(self.poll_interval, deadline - now)
                time.sleep(wait)
                continue
            admitted = self._sequencer.admit(step)
            assert admitted  # we asked for exactly next_step
            return ReceivedStep(step=step, rank=self.rank, payload=payload)

    def close(self) -> None:
        self._closed = True
