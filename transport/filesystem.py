"""Filesystem step transport (docs/transports.md, "Filesystem"), for trainers that share a
directory with the ship workers instead of a network path.

Layout: `{output_dir}/rollouts/step_{step}/rank_{rank}.bin`. A payload is written to a
hidden temporary name in the same directory and then renamed over the final name, so a
reader that sees `rank_{rank}.bin` sees the whole file (rename is atomic within a
filesystem). A repeated send of a step replaces the file with identical bytes.

The layout names its run in `{output_dir}/rollouts/run_id`, written by the first sender
before any payload: a sender of another run refuses the directory (two runs writing one
layout would mix their steps), and rlship's receivers read a step only from their own
run's layout (a foreign one is counted in `foreign_dropped` and logged once). prime-rl's
stock receivers read the payload files alone and are unaffected.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from pathlib import Path

from transport.base import Closeable, Payload, ReceivedStep, SequencedReceiver, StepSequencer
from transport.run_files import RefusedFile, foreign_write_problem, space_for

logger = logging.getLogger("rlship.transport")


def step_dir(output_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(output_dir) / "rollouts" / f"step_{step}"


def payload_path(output_dir: str | os.PathLike[str], step: int, rank: int) -> Path:
    return step_dir(output_dir, step) / f"rank_{rank}.bin"


def layout_run_path(output_dir: str | os.PathLike[str]) -> Path:
    """The file that names the run whose steps the layout holds."""
    return Path(output_dir) / "rollouts" / "run_id"


def layout_run(output_dir: str | os.PathLike[str]) -> str | None:
    """The run the layout belongs to, or None before its first sender wrote it; a file that
    does not read (a directory of that name) names what is wrong, in <>, which no run matches."""
    try:  # bytes not UTF-8 name no run of ours: replaced, they match none
        return layout_run_path(output_dir).read_bytes().decode(errors="replace").strip() or None
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"<{layout_run_path(output_dir).name} unreadable: {exc.strerror}>"


class ForeignLayout(RuntimeError):
    """The directory already holds another run's steps."""


def claim_layout(output_dir: str | os.PathLike[str], run_id: str) -> None:
    """Name `run_id` as the layout's run (created atomically: of two first senders, one
    wins), or raise ForeignLayout if another run's name is there."""
    path = layout_run_path(output_dir)
    tmp = path.with_name(f".run_id.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    with space_for(path, len(run_id) + 1):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.write_text(run_id + "\n")
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # fails if the name exists: never replaces another run's
        finally:
            tmp.unlink(missing_ok=True)
    holder = layout_run(output_dir)
    if holder != run_id:
        raise ForeignLayout(
            f"{path.parent} holds the steps of run {holder}, not of run {run_id}: "
            "give each run its own output_dir"
        )


class FileSender(Closeable):
    """Writes each (step, rank) payload atomically, in a layout it claims for `run_id` when
    it starts (ForeignLayout if another run holds it). `fsync=True` also makes the bytes
    durable before the rename (a crash cannot leave a complete-looking but empty file); it
    is off by default because the readers are live processes, not crash recovery."""

    def __init__(self, output_dir: str | os.PathLike[str], *, run_id: str, fsync: bool = False) -> None:
        self.output_dir = Path(output_dir)
        self.fsync = fsync
        claim_layout(self.output_dir, run_id)
        self._closed = False

    def send(self, step: int, rank: int, payload: Payload) -> None:
        if self._closed:
            raise RuntimeError("FileSender is closed")
        if step < 0 or rank < 0:
            raise ValueError(f"step and rank must be >= 0, got step {step}, rank {rank}")
        final = payload_path(self.output_dir, step, rank)
        # Unique per writer, so two workers sending the same step never share a temp file;
        # the name does not end in `.bin`, so globbing readers never pick it up.
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        with space_for(final, memoryview(payload).nbytes):
            final.parent.mkdir(parents=True, exist_ok=True)
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

    def hand_over(self, step: int, rank: int, payload: Payload) -> None:
        """`send`: a file written is a step delivered (the ZMQ sender's pair of calls)."""
        self.send(step, rank, payload)

    def wait_left(self, step: int, rank: int) -> None:
        """Nothing to wait for: `hand_over` wrote the file."""

    def close(self) -> None:
        self._closed = True


class FileReceiver(SequencedReceiver):
    """Reads one rank's payloads in step order by polling for the file of `next_step`.

    Unlike the ZMQ receiver, this one asks for a step by name, so it never sees duplicates
    and never reports a gap: if step 5 exists while step 4 does not, it keeps waiting for
    step 4 (a step written out of order by a redelivered task is still in time). Files are
    left in place; cleaning them up is the run's business. A layout of another run (or of
    none) is never read (module docstring), nor a file another user could have written.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        rank: int,
        *,
        run_id: str,
        next_step: int,
        poll_interval: float = 0.01,
        file_mode: str = "owner",
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.output_dir = Path(output_dir)
        self.run_id = run_id
        self.poll_interval = poll_interval
        self.file_mode = file_mode
        self.foreign_dropped = 0
        self._layout_checked = False
        self._foreign_step_seen = -1
        self._sequencer = StepSequencer(rank, next_step)
        self._closed = False

    def _own_layout(self, step: int) -> bool:
        """Whether the layout is this run's; a foreign one is counted once per step found
        in it and logged once."""
        if self._layout_checked:
            return True
        holder = layout_run(self.output_dir)
        if holder == self.run_id:
            self._layout_checked = True  # a layout's run never changes (claim_layout)
            return True
        if self._foreign_step_seen != step:
            if self._foreign_step_seen < 0:
                logger.error(
                    "rank %d of run %s: %s holds the steps of %s: not read (this rank is pointed "
                    "at another run's output_dir)",
                    self.rank, self.run_id, self.output_dir / "rollouts",
                    f"run {holder}" if holder else "no named run",
                )  # fmt: skip
            self._foreign_step_seen = step
            self.foreign_dropped += 1
        return False

    def receive(self, timeout: float | None = None) -> ReceivedStep | None:
        """The payload of `next_step`, or None if its file does not appear within `timeout`."""
        if self._closed:
            raise RuntimeError("FileReceiver is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        step = self.next_step
        path = payload_path(self.output_dir, step, self.rank)
        while True:
            payload = self._read(path, step)
            if payload is not None:
                admitted = self._sequencer.admit(step)
                assert admitted  # we asked for exactly next_step
                return ReceivedStep(step=step, rank=self.rank, payload=payload)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            time.sleep(self.poll_interval if deadline is None else min(self.poll_interval, deadline - now))

    def _read(self, path: Path, step: int) -> bytes | None:
        """The step's payload, if its file is there in this run's layout; `RefusedFile` if
        another user could have written it (`file_mode`)."""
        if not path.is_file() or not self._own_layout(step):  # a directory of that name is no payload
            return None
        try:
            with open(path, "rb") as f:
                problem = foreign_write_problem(path, os.fstat(f.fileno()), self.file_mode)
                if problem is not None:
                    raise RefusedFile(f"rank {self.rank}: step {step}'s payload file {problem}")
                return f.read()
        except (FileNotFoundError, IsADirectoryError):  # replaced meanwhile
            return None

    def close(self) -> None:
        self._closed = True
