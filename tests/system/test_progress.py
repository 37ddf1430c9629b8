"""`rlship run`'s progress display: tasks in flight per stage from the step marks, the status
lines, the in-place redraw; the reader against the real Redis keys the orchestrator and the
workers write; terminal and plain output."""

from __future__ import annotations

import io
import json
import time

import redis

from orchestrator.commands.progress import ProgressDisplay, progress_bar, redraw, status_lines
from orchestrator.status_reader import STAGES, Snapshot, StatusReader, StepMarks, in_flight, parse_status
from transport.keys import RunKeys

STATUS = {
    "arrived": 300.0,
    "pending": 40.0,
    "in_open_groups": 6.0,
    "next_step": 5.0,
    "last_published": 1.0,
    "loop_lag_max_ms": 2.5,
    "updated_at": 1000.0,
}


def marks(step: int, *done: str, sent: tuple[int, ...] = ()) -> StepMarks:
    return StepMarks(step, frozenset(done), frozenset(sent))


def test_in_flight_follows_the_task_graph() -> None:
    steps = [
        marks(2, "finalize", "prune", "metrics", "pack", "encode:0", "encode:1", sent=(0, 1)),
        marks(3, "finalize", "prune", "pack", "encode:0", sent=(0,)),
        marks(4, "finalize"),
        marks(5),
    ]
    counts = in_flight(steps, ranks=2)
    assert counts == {
        "finalize": 1,  # step 5
        "prune": 1,  # step 4
        "metrics": 1,  # step 3
        "pack": 0,
        "encode": 1,  # step 3, rank 1
        "send": 0,  # step 3 rank 0 was sent
        "publish": 1,  # step 2: metrics done, every rank sent
    }
    assert list(counts) == list(STAGES)
    pack_pending = in_flight([marks(6, "finalize", "prune", "metrics")], ranks=2)
    assert (pack_pending["pack"], pack_pending["encode"], pack_pending["publish"]) == (1, 0, 0)
    encoded = in_flight([marks(7, "finalize", "prune", "metrics", "pack", "encode:0", "encode:1")], ranks=2)
    assert (encoded["send"], encoded["publish"]) == (2, 0)


def test_status_lines() -> None:
    snapshot = Snapshot(
        STATUS, (marks(2, "finalize"), marks(3)), {"cpu": 3, "ship": 1}, now=1001.5, stalled_ranks=(1,)
    )
    lines = status_lines(snapshot, total_steps=8, ranks=2, elapsed=12.34, lag_peak_ms=17.0)
    assert lines == [
        "steps [#####---------------] 2/8 shipped, 5 cut | 12.3 s",
        "rollouts buffered 46 (pending 40, in open groups 6) of 300 arrived",
        "in flight finalize 1 prune 1 metrics 0 pack 0 encode 0 send 0 publish 0 | queued cpu 3 ship 1",
        "loop lag 2.5 ms now, 17.0 ms max | status 1.5 s old | policy gate waits on rank(s) [1]",
    ]
    waiting = status_lines(Snapshot({}, (), {}, now=0.0), 8, 2, 0.5, 0.0)
    assert waiting == ["steps 0/8 | 0.5 s | waiting for the orchestrator's first status"]


def test_status_lines_count_steps_from_the_runs_start_step() -> None:
    """A run resumed at step 5 that has published 5 and 6 and cut 7: 2 shipped, 3 cut."""
    status = {**STATUS, "start_step": 5.0, "last_published": 6.0, "next_step": 8.0}
    lines = status_lines(Snapshot(status, (), {}, now=1000.0), 8, 2, 1.0, 0.0)
    assert lines[0] == "steps [#####---------------] 2/8 shipped, 3 cut | 1.0 s"


def test_progress_bar_and_parse_status() -> None:
    assert progress_bar(0, 4, width=4) == "[----]"
    assert progress_bar(3, 4, width=4) == "[###-]"
    assert progress_bar(9, 4, width=4) == "[####]"
    raw = {b"pending": b"3", b"loop_lag_max_ms": b"1.25", b"stalled_ranks": b"[0, 2]"}
    assert parse_status(raw) == ({"pending": 3.0, "loop_lag_max_ms": 1.25}, (0, 2))


def test_redraw_replaces_the_block_and_keeps_the_new_lines() -> None:
    assert redraw(0, [], ["a", "b"], width=80) == "a\nb\n"
    out = redraw(2, ["step 0 | " + "x" * 100], ["a" * 100, "b"], width=20)
    assert out == "\x1b[2F\x1b[J" + "step 0 | " + "x" * 100 + "\n" + "a" * 19 + "\nb\n"


def write_step(
    client: redis.Redis, state: RunKeys, step: int, *done: str, sent: tuple[int, ...] = ()
) -> None:
    for stage in done:
        client.set(state.step(step, f"done:{stage}"), 0.01, ex=60)
    if sent:
        client.sadd(state.step(step, "sent"), *sent)
        client.expire(state.step(step, "sent"), 60)


def publish_record(client: redis.Redis, state: RunKeys, step: int, lag_ms: float) -> None:
    record = {"step": step, "credit/group_baseline": 16, "event_loop_lag/max_ms": lag_ms}
    client.xadd(state.metrics_stream, {"step": step, "record": json.dumps(record)})


def cleanup(client: redis.Redis, run_id: str, *extra: str) -> None:
    keys = list(client.scan_iter(match=f"rlship:{run_id}:*"))
    client.delete(*keys, *extra)


def test_reader_reads_what_the_orchestrator_and_workers_write(client: redis.Redis, run_id: str) -> None:
    state = RunKeys(run_id)
    queue = f"cpu-{run_id}"
    try:
        publish_record(client, state, 0, 1.0)  # before the reader: not shown again
        reader = StatusReader(client, run_id, [queue, f"ship-{run_id}"], ranks=2)
        assert reader.snapshot().status == {} and reader.new_records() == []

        status = {**STATUS, "updated_at": time.time(), "stalled_ranks": "[1]"}
        client.hset(state.status, mapping=status)
        write_step(
            client, state, 2, "finalize", "prune", "metrics", "pack", "encode:0", "encode:1", sent=(0,)
        )
        write_step(client, state, 3, "finalize")
        client.lpush(queue, "m1", "m2")
        publish_record(client, state, 1, 4.0)

        assert [r["step"] for r in reader.new_records()] == [1]
        snapshot = reader.snapshot()
        assert snapshot.status["pending"] == 40.0 and snapshot.stalled_ranks == (1,)
        assert [m.step for m in snapshot.steps] == [2, 3, 4]
        assert snapshot.steps[0].sent == {0} and "encode:1" in snapshot.steps[0].done
        assert snapshot.queued == {queue: 2, f"ship-{run_id}": 0}
        assert in_flight(snapshot.steps, 2)["send"] == 1

        # The orchestrator stops writing its status after the last record: the records count.
        publish_record(client, state, 2, 1.0)
        reader.new_records()
        assert reader.snapshot().status["last_published"] == 2
        assert [m.step for m in reader.snapshot().steps] == [3, 4]
    finally:
        cleanup(client, run_id, queue)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_display_in_a_terminal_and_in_a_log(client: redis.Redis, run_id: str) -> None:
    state = RunKeys(run_id)
    try:
        client.hset(state.status, mapping={**STATUS, "updated_at": time.time()})
        terminal, log = Terminal(), io.StringIO()
        displays = [
            ProgressDisplay(StatusReader(client, run_id, ["cpu"], 2), stream, total_steps=4, ranks=2)
            for stream in (terminal, log)
        ]
        for display in displays:
            display.update()
        publish_record(client, state, 0, 9.0)
        for display in displays:
            display.update()
            display.update(status=True)

        out = terminal.getvalue()
        assert out.count("\x1b[4F\x1b[J") == 2 and out.count("step 0 | rollouts 16") == 1
        last_frame = out.rsplit("\x1b[4F\x1b[J", 1)[1].splitlines()
        assert last_frame[0].startswith("steps [##########----------] 2/4 shipped")
        assert last_frame[3].startswith("loop lag 2.5 ms now, 9.0 ms max")

        lines = log.getvalue().splitlines()
        assert "\x1b" not in log.getvalue()
        assert lines[0].startswith("step 0 | rollouts 16")
        assert lines[1].startswith("status: steps [##########----------] 2/4 shipped") and len(lines) == 2
    finally:
        cleanup(client, run_id)
