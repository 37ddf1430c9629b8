"""Filesystem step transport: atomic writes seen from another process, order, round trip."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import random
import time
from pathlib import Path
from typing import Any

import pytest

from transport.base import StepReceiver, StepSender
from transport.filesystem import FileReceiver, FileSender, ForeignLayout, payload_path

MIB = 1 << 20
CTX = mp.get_context("spawn")
WAIT = 30.0


def payload_for(step: int, rank: int) -> bytes:
    sizes = [0, 7, 2 * MIB + 3, 6 * MIB, 512 * 1024]
    return random.Random(step * 1000 + rank).randbytes(sizes[(step + rank) % len(sizes)])


def digest(payload: bytes | memoryview) -> str:
    return hashlib.sha256(payload).hexdigest()


def writer_main(
    output_dir: str, order: list[int], ranks: int, rewrite: bool, pause: float, done: Any
) -> None:
    """Child process: write every (step, rank) in `order`, then (optionally) all of them again,
    so that readers also race against a rename over an existing file."""
    with FileSender(output_dir, run_id="t") as sender:
        for _ in range(2 if rewrite else 1):
            for step in order:
                for rank in range(ranks):
                    sender.send(step, rank, payload_for(step, rank))
                time.sleep(pause)
    done.set()


def watcher_main(output_dir: str, steps: int, ranks: int, writer_done: Any, queue: Any) -> None:
    """Child process: poll every `.bin` file as fast as possible while the writer works and
    report any that is not exactly the expected payload (a partially written file)."""
    expected = {(s, r): payload_for(s, r) for s in range(steps) for r in range(ranks)}
    sizes = {key: len(data) for key, data in expected.items()}
    bad: list[str] = []
    seen: set[tuple[int, int]] = set()
    observations = 0
    deadline = time.monotonic() + WAIT
    final_pass = False
    while time.monotonic() < deadline:
        final_pass = writer_done.is_set()
        for path in Path(output_dir, "rollouts").glob("step_*/*.bin"):
            try:
                key = (int(path.parent.name.removeprefix("step_")), int(path.stem.removeprefix("rank_")))
            except ValueError:
                bad.append(f"unexpected name {path}")
                continue
            if key not in expected:
                bad.append(f"unexpected file {path}")
                continue
            observations += 1
            size = path.stat().st_size
            if size != sizes[key]:
                bad.append(f"{path}: size {size}, expected {sizes[key]}")
            if key not in seen or final_pass:
                data = path.read_bytes()
                if data != expected[key]:
                    bad.append(f"{path}: content differs ({len(data)} bytes)")
                seen.add(key)
        if final_pass:
            break
    queue.put((final_pass, sorted(seen), observations, bad))


def receiver_main(output_dir: str, rank: int, steps: int, queue: Any) -> None:
    with FileReceiver(output_dir, rank, poll_interval=0.005, next_step=0, run_id="t") as receiver:
        for _ in range(steps):
            got = receiver.receive(WAIT)
            if got is None:
                queue.put(("timeout", rank, receiver.next_step))
                return
            queue.put(("step", rank, got.step, digest(got.payload)))
        queue.put(("done", rank, receiver.duplicates_dropped, receiver.gaps, receiver.next_step))


def start(procs: list[Any], target: Any, *args: Any) -> Any:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    procs.append(proc)
    return proc


@pytest.mark.timeout(60)
def test_no_partial_file_is_ever_visible(tmp_path: Path, procs: list[Any]) -> None:
    steps, ranks = 8, 2
    queue, writer_done = CTX.Queue(), CTX.Event()
    watcher = start(procs, watcher_main, str(tmp_path), steps, ranks, writer_done, queue)
    start(procs, writer_main, str(tmp_path), list(range(steps)), ranks, True, 0.0, writer_done)
    finished, seen, observations, bad = queue.get(timeout=WAIT + 10)
    watcher.join(timeout=WAIT)
    assert finished, "the writer did not finish in time"
    assert bad == []
    assert seen == [(s, r) for s in range(steps) for r in range(ranks)]
    assert observations >= steps * ranks
    assert list(tmp_path.rglob("*.tmp")) == []


@pytest.mark.timeout(60)
def test_receivers_in_other_processes_get_every_step_in_order(tmp_path: Path, procs: list[Any]) -> None:
    """The writer produces steps out of order (2, 0, 3, 1): a receiver waits for its next
    step instead of skipping ahead, so this is neither a gap nor a reordering."""
    steps, ranks = 4, 2
    queue, writer_done = CTX.Queue(), CTX.Event()
    for rank in range(ranks):
        start(procs, receiver_main, str(tmp_path), rank, steps, queue)
    start(procs, writer_main, str(tmp_path), [2, 0, 3, 1], ranks, False, 0.2, writer_done)
    reports: list[tuple[Any, ...]] = []
    while len([r for r in reports if r[0] == "done"]) < ranks:
        report = queue.get(timeout=WAIT)
        assert report[0] != "timeout", report
        reports.append(report)
    for rank in range(ranks):
        mine = [r for r in reports if r[0] == "step" and r[1] == rank]
        assert [(r[2], r[3]) for r in mine] == [(s, digest(payload_for(s, rank))) for s in range(steps)]
        (done,) = [r for r in reports if r[0] == "done" and r[1] == rank]
        assert done[2:] == (0, [], steps)


def test_layout_and_round_trip(tmp_path: Path) -> None:
    with (
        FileSender(tmp_path, run_id="t") as sender,
        FileReceiver(tmp_path, 1, next_step=0, run_id="t") as receiver,
    ):
        assert isinstance(sender, StepSender)
        assert isinstance(receiver, StepReceiver)
        for kind in (bytes, bytearray, memoryview):
            sender.send(receiver.next_step, 1, kind(b"payload %d" % receiver.next_step))
            got = receiver.receive(1.0)
            assert got is not None and bytes(got.payload) == b"payload %d" % got.step
        assert (tmp_path / "rollouts" / "step_2" / "rank_1.bin").read_bytes() == b"payload 2"
        assert payload_path(tmp_path, 2, 1) == tmp_path / "rollouts" / "step_2" / "rank_1.bin"
        assert sorted(p.name for p in (tmp_path / "rollouts" / "step_0").iterdir()) == ["rank_1.bin"]


def test_a_layout_belongs_to_one_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first sender names its run in `rollouts/run_id`; a sender of another run refuses
    the directory, and a receiver of another run reads nothing from it (counted per step,
    logged once). A layout without the file (a sender of no rlship run) is not read either."""
    caplog.set_level(logging.ERROR, logger="rlship.transport")
    unnamed = tmp_path / "unnamed"
    payload_path(unnamed, 0, 0).parent.mkdir(parents=True)
    payload_path(unnamed, 0, 0).write_bytes(b"whose?")
    with FileReceiver(unnamed, 0, next_step=0, run_id="b", poll_interval=0.01) as nobodys:
        assert nobodys.receive(0.05) is None and nobodys.foreign_dropped == 1
    with FileSender(tmp_path, run_id="a") as sender:
        sender.send(0, 0, b"a's step 0")
        sender.send(1, 0, b"a's step 1")
    assert (tmp_path / "rollouts" / "run_id").read_text() == "a\n"
    with pytest.raises(ForeignLayout, match=r"holds the steps of run a, not of run b: give each run its own"):
        FileSender(tmp_path, run_id="b")
    with FileReceiver(tmp_path, 0, next_step=0, run_id="b", poll_interval=0.01) as foreign:
        assert foreign.receive(0.05) is None and foreign.receive(0.05) is None
        assert (foreign.foreign_dropped, foreign.next_step) == (1, 0), "counted once per step, nothing read"
    with FileReceiver(tmp_path, 0, next_step=0, run_id="a") as own, FileSender(tmp_path, run_id="a"):
        got = own.receive(1.0)
        assert got is not None and bytes(got.payload) == b"a's step 0"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    why = "not read (this rank is pointed at another run's output_dir)"
    assert errors == [
        f"rank 0 of run b: {unnamed / 'rollouts'} holds the steps of no named run: {why}",
        f"rank 0 of run b: {tmp_path / 'rollouts'} holds the steps of run a: {why}",
    ]


def test_receive_waits_for_next_step_even_if_a_later_one_exists(tmp_path: Path) -> None:
    sender = FileSender(tmp_path, run_id="t")
    receiver = FileReceiver(tmp_path, 0, next_step=3, run_id="t")
    sender.send(4, 0, b"four")
    start_time = time.monotonic()
    assert receiver.receive(0.2) is None
    assert time.monotonic() - start_time < 5
    assert receiver.receive(0) is None
    assert (receiver.next_step, receiver.gaps) == (3, [])
    sender.send(3, 0, b"three")
    sender.send(3, 0, b"three")  # a resend replaces the file; the receiver still sees it once
    got = [receiver.receive(1.0), receiver.receive(1.0)]
    assert [(g.step, g.payload) for g in got if g is not None] == [(3, b"three"), (4, b"four")]
    assert (receiver.next_step, receiver.duplicates_dropped, receiver.gaps) == (5, 0, [])
    receiver.close()
    with pytest.raises(RuntimeError):
        receiver.receive(0)


def test_failed_write_leaves_no_file(tmp_path: Path) -> None:
    sender = FileSender(tmp_path, fsync=True, run_id="t")
    with pytest.raises(TypeError):
        sender.send(0, 0, 12345)  # type: ignore[arg-type]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [tmp_path / "rollouts" / "run_id"]
    sender.send(0, 0, b"ok")
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["rank_0.bin", "run_id"]
    sender.close()
    with pytest.raises(RuntimeError):
        sender.send(1, 0, b"closed")
