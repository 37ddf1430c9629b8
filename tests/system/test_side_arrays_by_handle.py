"""Side arrays by handle (`payload` segments, prime-rl's 0f59b24 wire) against the real Redis,
real Celery workers, real trainer processes and real files:

- `rlship run --workload moe`, as a user starts it: every step ships, each rank's checksum
  of the rows it read equals the encoder's for every step, and no byte of routed experts
  went into Redis (Redis's own MONITOR feed of the run, searched for the rows; the rows made
  again from the synthetic workload's seed, and found not to be stand-ins: each rollout's
  token ids are found in the same feed).
- Stock prime-rl 0f59b24 trainer ranks (tests/support/stock_peers.py) read, for every trace
  id of every step, exactly the rows the test wrote for that rollout (sha256 kept by the
  test when it wrote them: the files may be gone after the run), in two layouts: one file
  per rollout as `write_segment_file` writes it, and a file written by hand with a header,
  a field's rows in two segments stored out of order, and a second field after them.
- A rollout whose rows file is gone before the cut, and one whose file is short, are
  dropped with reasons naming `payload.routed_experts` and the file, counted under
  `payload.routed_experts` in their step's record; the step ships the others, whose rows the stock ranks
  read as written.
- `rlship run --workload moe --wire prime-rl-559b447` fails at once in one line naming the
  wire and the field, and leaves no process or key.
- A producer of a run whose wire is 559b447 refuses a call with handles, writing nothing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import re
import socket
import subprocess
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.commands.produce import SyntheticWorkload
from orchestrator.producer import AsyncRolloutProducer, RolloutProducer, RolloutRejected
from orchestrator.settings import RunSettings
from tests.support.factories import group
from tests.support.processes import left_running, refused, rlship, session_queue
from tests.support.shiprun import metrics_lines, run_orchestrator, ship_settings
from tests.support.stock_peers import WIRE_0F59B24, read_record, start_stock_ranks
from transport.checksum import payload_checksum
from transport.connection import connect_redis_async
from transport.keys import RunKeys
from transport.payload_segments import PayloadSegment, rollout_rows_path, write_segment_file
from transport.zmq_sockets import free_port_pair

pytestmark = pytest.mark.timeout(300)

LAYERS, TOPK = 48, 8  # routed experts as the moe workload makes them: [tokens, 48, 8] uint8
MASK_WIDTH = 4  # a second field by handle: int32 [tokens, 4]
HEADER = b"rows-file-header"  # 16 bytes before the rows of a hand-written file


# --- Redis's MONITOR feed, raw -----------------------------------------------------------


def redis_repr(data: bytes) -> bytes:
    """`data` as MONITOR shows an argument (redis's sdscatrepr): backslash and double quote
    escaped, \\n \\r \\t \\a \\b by name, other bytes outside 0x20-0x7e as \\xhh."""
    named = {
        0x5C: b"\\\\",
        0x22: b'\\"',
        0x0A: b"\\n",
        0x0D: b"\\r",
        0x09: b"\\t",
        0x07: b"\\a",
        0x08: b"\\b",
    }
    out = bytearray()
    for byte in data:
        if byte in named:
            out += named[byte]
        elif 0x20 <= byte <= 0x7E:
            out.append(byte)
        else:
            out += b"\\x%02x" % byte
    return bytes(out)


_ESCAPE = re.compile(rb"\\(x[0-9a-f]{2}|.)", re.DOTALL)
_UNNAMED = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}


def redis_unrepr(shown: bytes) -> bytes:
    """The inverse of `redis_repr`."""

    def one(match: re.Match[bytes]) -> bytes:
        code = match.group(1)
        if code.startswith(b"x") and len(code) == 3:
            return bytes([int(code[1:], 16)])
        return _UNNAMED.get(code, code)

    return _ESCAPE.sub(one, shown)


class CommandFeed:
    """Every command Redis runs (MONITOR, on a socket of its own) whose line names `token`,
    as Redis shows it: one line per command, each argument quoted and escaped."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.address = (host, port)
        self.token = token.encode()
        self.marker = f"end-of-feed-{uuid.uuid4().hex}".encode()
        self.lines: list[bytes] = []
        self.ended = threading.Event()
        self.socket = socket.create_connection(self.address, timeout=10)
        self.socket.sendall(b"MONITOR\r\n")
        reply = b""
        while not reply.endswith(b"\r\n"):
            reply += self.socket.recv(1)
        assert reply == b"+OK\r\n", reply
        self.socket.settimeout(None)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        pending = b""
        while True:
            try:
                data = self.socket.recv(1 << 20)
            except OSError:
                break
            if not data:
                break
            pending += data
            *complete, pending = pending.split(b"\r\n")
            for line in complete:
                if self.marker in line:
                    self.ended.set()
                    return
                if self.token in line:
                    self.lines.append(line)

    def close(self) -> None:
        """Stop after every command Redis ran before this call: an ECHO of a marker is sent
        on another connection, and the feed read until it shows it (Redis feeds its monitors
        in the order it runs commands)."""
        with socket.create_connection(self.address, timeout=10) as other:
            other.sendall(b"ECHO %s\r\n" % self.marker)
            other.recv(1024)
        ended = self.ended.wait(60)
        self.socket.close()
        self.thread.join(10)
        assert ended, "the MONITOR feed never showed the end marker"


def queued_task_bodies(lines: list[bytes], queues: tuple[str, ...]) -> bytes:
    """The decoded bodies of the Celery messages the feed shows pushed to `queues` (kombu
    writes a JSON envelope with the task's arguments base64-encoded: a search of the raw
    feed would not see rows there)."""
    bodies = []
    names = {queue.encode() for queue in queues}
    for line in lines:
        args = re.findall(rb'"((?:[^"\\]|\\.)*)"', line)
        if len(args) >= 3 and args[0].upper() in (b"LPUSH", b"RPUSH") and args[1] in names:
            for shown in args[2:]:
                envelope = json.loads(redis_unrepr(shown))
                assert envelope["properties"]["body_encoding"] == "base64", envelope
                bodies.append(base64.b64decode(envelope["body"]))
    return b"\n".join(bodies)


# --- rollouts whose side arrays are in files, written by the test -------------------------


def write_rows_by_hand(path: Path, experts: np.ndarray, mask: np.ndarray, split: int) -> list[PayloadSegment]:
    """A rows file laid out as `write_segment_file` never does: a header, the experts of
    tokens [split, n) before those of [0, split), then the mask; its segments, each with
    the checksum of its rows."""
    later, earlier = experts[split:], experts[:split]
    with open(path, "wb") as out:
        for part in (HEADER, later.tobytes(), earlier.tobytes(), mask.tobytes()):
            out.write(part)
    row = LAYERS * TOPK
    n = len(experts)
    experts_at = len(HEADER)
    return [
        PayloadSegment("routed_experts", str(path), experts_at, split, n - split, "uint8", (LAYERS, TOPK),
                       payload_checksum(later.tobytes())),
        PayloadSegment("routed_experts", str(path), experts_at + (n - split) * row, 0, split, "uint8",
                       (LAYERS, TOPK), payload_checksum(earlier.tobytes())),
        PayloadSegment("sampling_mask", str(path), experts_at + n * row, 0, n, "int32", (MASK_WIDTH,),
                       payload_checksum(mask.tobytes())),
    ]  # fmt: skip


def produce_with_rows(
    producer: RolloutProducer, settings: RunSettings, groups: int, seed: int
) -> tuple[dict[str, dict[str, str]], dict[str, Path]]:
    """`groups` groups of 4 (rewards 1, 0, 1, 0: all trainable), each rollout's routed
    experts and mask in its own file under the run's payload root, passed by handle; every
    other rollout's file written by hand. Returns, per rollout, the sha256 of each field's
    rows as written (the oracle, kept here: the run may delete the files) and its file."""
    rng = np.random.default_rng(seed)
    expected: dict[str, dict[str, str]] = {}
    files: dict[str, Path] = {}
    for index in range(groups):
        rollouts = []
        for position, (record, arrays) in enumerate(group(f"g{index}", [1.0, 0.0, 1.0, 0.0],
                                                          num_output_tokens=10 + index)):  # fmt: skip
            n = record.num_tokens
            experts = rng.integers(0, 128, (n, LAYERS, TOPK), dtype=np.uint8)
            mask = rng.integers(-1, 1000, (n, MASK_WIDTH), dtype=np.int32)
            path = rollout_rows_path(settings.payload_root, settings.run_id, record.rollout_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            if position % 2:
                segments = write_rows_by_hand(path, experts, mask, split=n // 3)
            else:
                segments = write_segment_file(path, {"routed_experts": experts, "sampling_mask": mask})
            rollouts.append((record, {**arrays, "payload": segments}))
            expected[record.rollout_id] = {
                "routed_experts": hashlib.sha256(experts.tobytes()).hexdigest(),
                "sampling_mask": hashlib.sha256(mask.tobytes()).hexdigest(),
            }
            files[record.rollout_id] = path
        producer.produce(rollouts)
    return expected, files


def peer_report(records: list[Path], peers: list[subprocess.Popen]) -> str:
    """Each stock rank's exit status and the end of its log."""
    lines = []
    for rank, (record, peer) in enumerate(zip(records, peers, strict=True)):
        log = Path(f"{record}.log")
        text = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        lines.append(f"stock rank {rank}: exit {peer.poll()}; log: {text}")
    return "\n".join(lines)


async def ship_watching(settings: RunSettings, records: list[Path], peers: list[subprocess.Popen]) -> None:
    """The run's orchestrator on this event loop, stopped as soon as a stock rank fails (a
    rank that cannot read its rows stops with an error, and the run would wait for it)."""
    run = asyncio.create_task(run_orchestrator(settings))
    try:
        while not run.done():
            if any(peer.poll() not in (None, 0) for peer in peers):
                raise AssertionError(f"a stock rank failed during the run\n{peer_report(records, peers)}")
            await asyncio.wait({run}, timeout=0.1)
        await run
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)


def ship_to_0f59b24_ranks(settings: RunSettings) -> list[list[dict[str, Any]]]:
    """Ship the run (its rollouts written beforehand) to stock prime-rl 0f59b24 ranks, over
    ZMQ, each exiting after the run's steps; what each recorded, step by step."""
    records, peers = start_stock_ranks(settings, [settings.steps] * settings.ranks, wire=WIRE_0F59B24)
    try:
        asyncio.run(ship_watching(settings, records, peers))
        for peer in peers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                peer.wait(60)
        assert [peer.poll() for peer in peers] == [0] * len(peers), peer_report(records, peers)
    finally:
        for peer in peers:
            peer.kill()
            peer.wait()
    return [read_record(record) for record in records]


def rows_read(got: list[list[dict[str, Any]]]) -> dict[str, dict[str, str]]:
    """{trace id: {field: sha256}} over every rank and step; a trace id read twice fails."""
    rows: dict[str, dict[str, str]] = {}
    for lines in got:
        for line in lines:
            for trace_id, fields in line["rows"].items():
                assert trace_id not in rows, f"{trace_id}: rows read in two steps or by two ranks"
                rows[trace_id] = fields
    return rows


def stock_settings(run_id: str, redis_url: str, workers, output_dir: Path, steps: int) -> RunSettings:
    return ship_settings(
        run_id, redis_url, workers, output_dir, steps=steps, batch_size=8, group_size=4,
        max_off_policy_steps=100, trainers="external", wire=WIRE_0F59B24,
        record_rollouts=output_dir / "rollouts.jsonl",
        record_names="rlship-1",  # rlship-1: its progress/rollouts counts the shipped rollouts
    )  # fmt: skip


def delete_run_keys(client, run_id: str) -> None:
    """Every key of the run (the session's workers and their queues stay)."""
    keys = list(client.scan_iter(match=RunKeys(run_id).prefix + "*", count=1000))
    for start in range(0, len(keys), 1000):
        client.unlink(*keys[start : start + 1000])


# --- the tests ----------------------------------------------------------------------------


def test_rlship_run_moe_reads_every_row_by_handle_and_none_enters_redis(client, redis_url, tmp_path):
    run_id = f"cli-moe-{uuid.uuid4().hex[:8]}"
    summary_path = tmp_path / "summary.json"
    seed = 7
    queues = (session_queue(f"cpu-{run_id}"), session_queue(f"ship-{run_id}"))
    command = [
        "run", "--workload", "moe", "--steps", "3", "--ranks", "2",
        "--batch-size", "16", "--group-size", "4", "--seq-len", "512", "--seed", str(seed),
        "--run-id", run_id, "--zmq-port", str(free_port_pair()), "--output-dir", str(tmp_path / "run"),
        "--cpu-queue", queues[0], "--ship-queue", queues[1], "--summary-json", str(summary_path),
    ]  # fmt: skip
    host = client.connection_pool.connection_kwargs.get("host", "127.0.0.1")
    port = client.connection_pool.connection_kwargs.get("port", 6379)
    feed = CommandFeed(host, port, run_id)
    try:
        done = rlship(*command, env={"REDIS_URL": redis_url}, timeout=240)
    finally:
        feed.close()
    try:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads(summary_path.read_text())
        assert summary["steps_shipped"] == 3
        sent = summary["sent_rows_checksums"]
        assert sorted(sent) == [f"{step}:{rank}" for step in range(3) for rank in range(2)], sent
        for rank in ("0", "1"):
            got = summary["ranks"][rank]
            assert got["steps"] == [0, 1, 2]
            assert got["rows_checksums"] == {str(s): sent[f"{s}:{rank}"] for s in range(3)}, (rank, got, sent)

        # The rollouts the producer wrote to Redis (the produce script's SET of each), made
        # again from the seed with their routed experts inline.
        feed_bytes = b"\n".join(feed.lines)
        stored = re.compile(rb'"SET" "' + re.escape(RunKeys(run_id).rollout("").encode()) + rb'([^":]+)"')
        written = {match.decode() for match in stored.findall(feed_bytes)}
        assert len(written) >= 3 * 16, f"{len(written)} rollouts written"
        settings = RunSettings(run_id=run_id, seed=seed, group_size=4, seq_len=512, workload="moe")
        workload = SyntheticWorkload(
            seed=seed, group_size=4, seq_len=512, vocab_size=settings.vocab_size, moe_inline=True
        )
        made: dict[str, dict[str, np.ndarray]] = {}
        while not written <= made.keys():
            assert len(made) < 100_000, sorted(written - made.keys())[:5]
            made |= {record.rollout_id: arrays for record, arrays in workload.group()}
        # The control: each rollout's token ids (int32, in its stored blob) are in the feed,
        # so the feed holds the producer's writes and the rollouts made again are the run's.
        absent = [rid for rid in written if redis_repr(made[rid]["input_ids"].tobytes()) not in feed_bytes]
        assert absent == [], f"token ids of {len(absent)} rollouts not in the feed, e.g. {absent[:3]}"
        # No token's row of routed experts (384 bytes) in any command naming the run, nor in
        # the run's task messages.
        bodies = queued_task_bodies(feed.lines, queues)
        assert bodies, "the feed shows the run's task messages"
        found = []
        for rid in sorted(written):
            experts = made[rid]["routed_experts"]
            for token in sorted({0, len(experts) // 2, len(experts) - 1}):
                row = experts[token].tobytes()
                if redis_repr(row) in feed_bytes or row in bodies:
                    found.append((rid, token))
        assert found == [], f"routed experts in Redis: {len(found)} rows, e.g. {found[:3]}"
    finally:
        delete_run_keys(client, run_id)


def test_stock_0f59b24_ranks_read_every_rollouts_rows_as_written(
    client, redis_url, run_id, workers, tmp_path
):
    steps = 3
    settings = stock_settings(run_id, redis_url, workers, tmp_path, steps)
    producer = RolloutProducer.for_run(client, settings, admitted=False)
    expected, _ = produce_with_rows(producer, settings, groups=steps * 2 + 2, seed=1)
    try:
        got = ship_to_0f59b24_ranks(settings)
        records = metrics_lines(settings)
    finally:
        delete_run_keys(client, run_id)
    for rank, lines in enumerate(got):
        assert [line["topic_step"] for line in lines] == [1, 2, 3], f"rank {rank}: every step once, in order"
        assert all(line["rows"] for line in lines), f"rank {rank}: every step carries rows by handle"
    rows = rows_read(got)
    assert len(rows) == sum(r["progress/rollouts"] for r in records) == steps * 8
    wrong = {tid: (fields, expected.get(tid)) for tid, fields in rows.items() if fields != expected.get(tid)}
    assert wrong == {}, f"{len(wrong)} of {len(rows)} trace ids read other rows than were written"


def test_a_rollout_whose_rows_file_is_gone_short_or_writable_by_others_is_dropped_and_its_step_ships_the_rest(
    client, redis_url, run_id, workers, tmp_path
):
    steps = 2
    settings = stock_settings(run_id, redis_url, workers, tmp_path, steps)
    producer = RolloutProducer.for_run(client, settings, admitted=False)
    expected, files = produce_with_rows(producer, settings, groups=steps * 2 + 2, seed=2)
    # After the producer's check, before the cut: one file deleted, one cut short, one made
    # writable by its group (another user could have replaced its rows).
    gone, short, writable = "g0-r0", "g0-r1", "g0-r2"
    files[gone].unlink()
    os.truncate(files[short], 100)
    files[writable].chmod(0o664)
    try:
        got = ship_to_0f59b24_ranks(settings)
        records = metrics_lines(settings)
    finally:
        delete_run_keys(client, run_id)
    fates = {line["rollout_id"]: line for line in map(json.loads, (tmp_path / "rollouts.jsonl").open())}
    dropped = (gone, short, writable)
    for rollout_id in dropped:
        fate = fates[rollout_id]
        assert fate["fate"] == "discarded", fate
        assert fate["reason"].startswith("invalid_payload: payload.routed_experts: "), fate
        assert str(files[rollout_id]) in fate["reason"], fate
    assert f"{files[writable]} is group-writable (mode 0664): refused" in fates[writable]["reason"]
    assert [int(r["step"]) for r in records] == [1, 2], "every step shipped"
    by_step = {int(r["step"]): r for r in records}
    assert sum(r["progress/dropped_by_workers"] for r in records) == 3.0, "no other drop"
    for step in {fates[rid]["discarded_step"] for rid in dropped}:
        dropped_here = [rid for rid in dropped if fates[rid]["discarded_step"] == step]
        record = by_step[step]
        assert record["progress/dropped_by_workers"] == len(dropped_here), record
        shipped_here = [
            rid for rid, f in fates.items() if f["fate"] == "shipped" and f["shipped_step"] == step
        ]
        assert record["progress/rollouts"] == len(shipped_here) == 8 - len(dropped_here), "the others ship"
    rows = rows_read(got)
    shipped = {rid for rid, fate in fates.items() if fate["fate"] == "shipped"}
    assert set(rows) == shipped and not set(dropped) & set(rows)
    assert {tid: rows[tid] for tid in shipped} == {tid: expected[tid] for tid in shipped}
    # Counted under `payload.{field}` (docs/wire-format.md, "Side arrays by handle"; the
    # record's `progress/dropped_by_workers/{field}`, docs/metrics.md).
    counted: Counter[str] = Counter()
    for record in records:
        counted.update({k: v for k, v in record.items() if k.startswith("progress/dropped_by_workers/")})
    assert counted == {"progress/dropped_by_workers/payload.routed_experts": 3.0}, counted


def test_moe_on_the_559b447_wire_is_refused_at_start_up_leaving_nothing(client, redis_url, tmp_path):
    run_id = f"cli-moe-{uuid.uuid4().hex[:8]}"
    try:
        done = rlship(
            "run", "--workload", "moe", "--wire", "prime-rl-559b447", "--steps", "1", "--run-id", run_id,
            "--output-dir", str(tmp_path / "run"), "--zmq-port", str(free_port_pair()),
            "--cpu-queue", session_queue(f"cpu-{run_id}"), "--ship-queue", session_queue(f"ship-{run_id}"),
            env={"REDIS_URL": redis_url},
        )  # fmt: skip
        output = refused(done, "prime-rl-559b447", "payload")
        assert len(output.splitlines()) == 1, output
        assert left_running(run_id) == []
        assert list(client.scan_iter(match=f"*{run_id}*", count=1000)) == []
    finally:
        delete_run_keys(client, run_id)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_producer_refuses_handles_into_a_559b447_run_and_writes_nothing(
    api, client, redis_url, run_id, tmp_path
):
    settings = RunSettings(
        run_id=run_id, redis_url=redis_url, output_dir=tmp_path, wire="prime-rl-559b447", group_size=2
    )
    (plain, plain_arrays), (record, arrays) = group("g0", [1.0, 0.0])
    path = rollout_rows_path(settings.payload_root, run_id, record.rollout_id)
    path.parent.mkdir(parents=True)
    experts = np.zeros((record.num_tokens, LAYERS, TOPK), dtype=np.uint8)
    call = [
        (plain, plain_arrays),
        (record, {**arrays, "payload": write_segment_file(path, {"routed_experts": experts})}),
    ]
    with pytest.raises(RolloutRejected) as info:
        if api == "sync":
            RolloutProducer.for_run(client, settings).produce(call)
        else:

            async def produce() -> None:
                async_client = connect_redis_async(redis_url)
                try:
                    await AsyncRolloutProducer.for_run(async_client, settings).produce(call)
                finally:
                    await async_client.aclose()

            asyncio.run(produce())
    assert list(info.value.problems) == [record.rollout_id]
    problem = info.value.problems[record.rollout_id]
    assert problem.startswith("payload: ") and "prime-rl-559b447" in problem, problem
    assert list(client.scan_iter(match=RunKeys(run_id).prefix + "*", count=1000)) == [], "nothing written"
