"""Fuzzed input (issue 38) at a trainer rank's receivers: multipart messages of any frame
count, topic and size as the ZMQ receiver's socket hands them over (`_accept`), and a
filesystem layout's run-id file and rank file of any content, size, kind and mode. Each
delivers exactly the step it names, or is dropped or refused cleanly: never a crash."""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import pytest
import zmq
from hypothesis import example

from tests.support.fuzz import fuzz, logged, mangled, text
from tests.support.processes import free_port
from transport.filesystem import FileReceiver, layout_run_path, payload_path
from transport.run_files import RefusedFile
from transport.zmq_receiver import ZMQReceiver

RUN, RANK = "fuzz", 1
BIG = bytes(4 << 20)  # an oversized payload, shared (not drawn anew each time)


def _frames(rng: random.Random) -> list[bytes]:
    """A topic of this rank or another, of this run, another or none, any step (duplicate,
    next, far ahead), maybe mangled; a payload empty, random, cut or oversized; two frames
    mostly, or none to five."""
    run = rng.choice([RUN, RUN, RUN, "other", None, text(rng)])
    step = rng.choice([rng.randint(0, 4), rng.randint(0, 4), rng.randint(0, 10**6), 10**18 - 1])
    head = b"data_rank|%d|%d" % (rng.choice([RANK, RANK, RANK, 0, 11]), step)
    if run is not None:
        head += b"|" + run.encode("utf-8", "surrogatepass")
    if rng.random() < 0.3:
        head = mangled(rng, head)
    payload = rng.choice([b"", rng.randbytes(rng.randint(1, 300)), BIG])
    extra = [rng.randbytes(rng.randint(0, 9)) for _ in range(3)]
    return [head, payload, *extra][: rng.choice([2, 2, 2, 2, 0, 1, 3, 5])]


@pytest.fixture(scope="module")
def zmq_port() -> int:
    return free_port()


@fuzz(messages=_frames)
@example(messages=[[b"data_rank|1|0|fuzz"], [], [b"data_rank|1|0|fuzz", b"", b""]])
def test_a_message_delivers_the_step_it_names_or_is_dropped(messages, zmq_port):
    """A fresh receiver a batch (its sequencer from step 0); a message is delivered only
    if it is two frames whose topic names this rank and run and a step not yet delivered."""
    receiver = ZMQReceiver("127.0.0.1", zmq_port, RANK, run_id=RUN, next_step=0, announce_interval=3600)
    try:
        for frames in messages:
            next_step = receiver.next_step
            counted = receiver.foreign_dropped + receiver._sequencer.duplicates_dropped
            with logged("rlship.transport") as messages_logged:
                receiver._accept([zmq.Frame(frame) for frame in frames])
            ours = len(frames) == 2 and frames[0].startswith(b"data_rank|%d|" % RANK)
            name = frames[0].split(b"|", 3) if ours else []
            ours = ours and name[2].isdigit() and len(name[2]) <= 18 and name[3:] == [RUN.encode()]
            if ours and int(name[2]) >= next_step:
                (step,) = receiver._ready
                receiver._ready.clear()
                assert (step.step, step.rank, bytes(step.payload)) == (int(name[2]), RANK, frames[1])
                continue
            assert not receiver._ready, frames
            dropped = receiver.foreign_dropped + receiver._sequencer.duplicates_dropped
            assert messages_logged or dropped > counted
    finally:
        receiver.close()


def _content(rng: random.Random, good: bytes) -> bytes | str | None:
    """A file's content: `good`, mangled, random, empty, oversized; or "dir" (a directory of
    that name), "link" (a symlink to a file elsewhere), or None (no file)."""
    if rng.random() < 0.01:  # oversized, rarely: a 4 MiB write costs as much as a hundred others
        return BIG
    return rng.choice(
        [good, good, mangled(rng, good), rng.randbytes(rng.randint(0, 40)), b"", "dir", "link", None]
    )


def _layout(rng: random.Random) -> tuple[bytes | str | None, bytes | str | None, int]:
    run_file = rng.choice([_content(rng, b"fuzz\n"), b"fuzz", b" fuzz \n", b"\xff", b"fuzz\x00", b"other\n"])
    rank_file = _content(rng, rng.randbytes(rng.randint(1, 200)))
    return run_file, rank_file, rng.choice([0o600, 0o644, 0o620, 0o602])


def _place(path: Path, content: bytes | str | None, mode: int, elsewhere: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == "dir":
        path.mkdir()
    elif content == "link":
        path.symlink_to(elsewhere)
    elif content is not None:
        path.write_bytes(content)
        path.chmod(mode)


@fuzz(batch=25, layouts=_layout)  # files: about 1 ms of CPU an input
@example(layouts=[("dir", None, 0o600)])  # run_id a directory: IsADirectoryError
def test_a_rank_file_is_read_or_refused_naming_the_step(layouts, tmp_path_factory):
    """Each input a fresh layout and receiver: the step's payload is read exactly as written
    in this run's layout from a file only its owner can write; otherwise None (not there, a
    directory, another run's layout) or `RefusedFile` naming the rank and step."""
    root = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    elsewhere = root / "elsewhere"
    elsewhere.write_bytes(b"not a payload")
    try:
        for index, (run_file, rank_file, mode) in enumerate(layouts):
            output_dir = root / str(index)
            _place(layout_run_path(output_dir), run_file, 0o600, elsewhere)
            _place(payload_path(output_dir, 3, RANK), rank_file, mode, elsewhere)
            receiver = FileReceiver(output_dir, RANK, run_id=RUN, next_step=3)
            try:
                received = receiver.receive(timeout=0)
            except RefusedFile as refused:
                assert str(refused).startswith(f"rank {RANK}: step 3's payload file "), refused
                assert mode & 0o022 and isinstance(rank_file, bytes)
                continue
            own = isinstance(run_file, bytes) and run_file.strip() == RUN.encode()
            if received is None:
                assert not own or rank_file in (None, "dir"), (run_file, rank_file)
                continue
            assert own and (received.step, received.rank) == (3, RANK)
            assert received.payload == (b"not a payload" if rank_file == "link" else rank_file)
    finally:
        shutil.rmtree(root)
