"""Trainer ranks that receive as prime-rl's stock ones do, not as rlship's own.

rlship's receiver reads the step from the topic, drops duplicates and replays gaps from
Redis. prime-rl's trainers (src/prime_rl/transport/zmq.py, filesystem.py) do none of that,
and rlship must still deliver every step to them exactly once, in order. These peers are
the test double of that behaviour, run as real processes (killable) by the tests and by
`rlship chaos --receivers stock`:

- ZMQ: a SUB socket subscribed to `data_rank|{rank}|`, a PUSH socket that sends READY (the
  rank as ASCII) once, when the peer starts, and never again; every message received is
  the next step of the peer's own count (from `--start-step`, default 1, as prime-rl
  numbers steps); the step in the topic is recorded for the oracle and otherwise ignored.
- Filesystem: polls `{output_dir}/rollouts/step_{n}/rank_{r}.bin` about once a second,
  `n` counted from `--start-step`.
- Policy progress (rank 0 only, as prime-rl): `{output_dir}/broadcasts/step_{n}/STABLE`
  for version 0 at start-up and version s after training step s, unless `--no-announce`;
  while the file `{record}.pause` exists it announces nothing, and on its removal it
  announces every version it held back, in order.

Each received step is appended to the `--record` file as one JSON line: the peer's own
step count, the topic and its step (ZMQ), the sha256 of the raw payload and its XXH3-128 (as
rlship's checksums are made: `rlship chaos` compares them with the run's), its size and the
number of micro-batches msgspec decoded from it (a payload that does not decode stops the
peer with an error).

`--wire` names the prime-rl trainer the peer decodes as:

- `prime-rl-559b447` (the default): a list of 16-field micro-batches (as msgspec decodes an
  array_like struct: a longer array decodes too, its extra trailing elements ignored).
- `prime-rl-0f59b24`: a list of 20-field micro-batches (tests/support/prime_0f59b24.py,
  written from prime-rl's source independently of rlship's codec), whose side arrays may
  come by handle (`payload` segments in files). As that trainer's ranks do, the peer reads
  them with `os.pread`: for every micro-batch whose `payload` is set, every payload field's
  rows of every sequence (named by its trace id; padding skipped). The line gets
  `"rows": {trace_id: {field: sha256 hex of the rows' bytes}}` over the step's micro-batches
  (`{}` when none carries a payload). A read that fails (missing file, short read), a
  micro-batch carrying a field both inline and by handle (prime-rl's trainer asserts), or
  sequences that cannot be named uniquely stop the peer with an error, before the line is
  written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash

from orchestrator.commands.bench.encode import WireMicroBatch
from tests.support import prime_0f59b24

if TYPE_CHECKING:  # the peers run as `python -m tests.support.stock_peers` and need no settings
    from orchestrator.settings import RunSettings

REPO = Path(__file__).resolve().parents[2]
POLL_SECONDS = 1.0  # prime-rl's filesystem receiver waits for a path about once a second


# What a 559b447 trainer decodes a payload into (prime-rl's msgspec MicroBatch, 16 fields).
_DECODER = msgspec.msgpack.Decoder(type=list[WireMicroBatch])

WIRE_559B447 = "prime-rl-559b447"
WIRE_0F59B24 = prime_0f59b24.WIRE  # "prime-rl-0f59b24"
WIRES = (WIRE_559B447, WIRE_0F59B24)
DEFAULT_WIRE = WIRE_559B447


def zmq_messages(host: str, port: int, rank: int) -> Iterator[tuple[bytes, bytes]]:
    """(topic, payload) per message, as prime-rl's ZMQ receiver gets them: READY once."""
    import zmq

    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://{host}:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"data_rank|%d|" % rank)
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://{host}:{port + 1}")
    push.send(str(rank).encode())  # once; a sender that starts again never hears it again
    while True:
        topic, payload = sub.recv_multipart()
        yield topic, payload


def file_messages(output_dir: Path, rank: int, start_step: int, poll: float) -> Iterator[tuple[bytes, bytes]]:
    """(b"", payload) per step file, asked for by the peer's own step count."""
    step = start_step
    while True:
        path = output_dir / "rollouts" / f"step_{step}" / f"rank_{rank}.bin"
        if not path.exists():
            time.sleep(poll)
            continue
        yield b"", path.read_bytes()
        step += 1


class Announcer:
    """Rank 0's policy announcements, held back while the pause file exists."""

    def __init__(self, output_dir: Path, pause_file: Path, enabled: bool) -> None:
        self.output_dir = output_dir
        self.pause_file = pause_file
        self.enabled = enabled
        self.announced = -1
        self.trained = -1
        self._lock = threading.Lock()

    def trained_through(self, version: int) -> None:
        self.trained = max(self.trained, version)
        self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self.enabled or self.pause_file.exists():
                return
            while self.announced < self.trained:
                self.announced += 1
                directory = self.output_dir / "broadcasts" / f"step_{self.announced}"
                directory.mkdir(parents=True, exist_ok=True)
                (directory / "STABLE").touch()

    def keep_flushing(self) -> None:
        """Announce what a pause held back as soon as it ends, with no step arriving: a
        trainer's policy gate sends none until it hears of progress."""
        while True:
            time.sleep(0.1)
            self.flush()


def payload_row_hashes(micro_batches: Sequence[prime_0f59b24.MicroBatch]) -> dict[str, dict[str, str]]:
    """{trace_id: {field: sha256 hex of its rows' bytes}} over the micro-batches that carry a
    payload, read as a 0f59b24 trainer rank reads them (raises on a failed read)."""
    rows: dict[str, dict[str, str]] = {}
    for index, batch in enumerate(micro_batches):
        if not batch.payload:  # as the trainer: an empty list is no payload
            continue
        if batch.routed_experts is not None or batch.sampling_mask is not None:
            raise ValueError(f"micro-batch {index} carries side arrays both inline and by handle")
        for field in prime_0f59b24.payload_fields(batch):
            for trace_id, data in prime_0f59b24.sequence_rows(batch, field).items():
                fields = rows.setdefault(trace_id, {})
                if field in fields:
                    raise ValueError(f"trace id {trace_id!r} has {field!r} rows in two micro-batches")
                fields[field] = hashlib.sha256(data).hexdigest()
    return rows


def run(args: argparse.Namespace) -> None:
    record = Path(args.record)
    record.parent.mkdir(parents=True, exist_ok=True)
    announcer = Announcer(
        Path(args.output_dir), pause_file_of(record), enabled=args.rank == 0 and args.announce
    )
    announcer.trained_through(args.start_step - 1)  # the weights it starts from
    threading.Thread(target=announcer.keep_flushing, daemon=True).start()
    if args.transport == "zmq":
        messages = zmq_messages(args.host, args.port, args.rank)
    else:
        messages = file_messages(Path(args.output_dir), args.rank, args.start_step, args.poll)
    step = args.start_step
    with open(record, "a") as out:
        for topic, payload in messages:
            rows = None
            if args.wire == WIRE_0F59B24:
                decoded = prime_0f59b24.decode_payload(payload)
                rows = payload_row_hashes(decoded)
            else:
                decoded = _DECODER.decode(payload)
            parts = topic.split(b"|")
            line = {
                "rank": args.rank,
                "step": step,
                "topic": topic.decode(errors="replace"),
                "topic_step": int(parts[2]) if len(parts) >= 3 and parts[2].isdigit() else None,
                "sha256": hashlib.sha256(payload).hexdigest(),
                "xxh3_128": xxhash.xxh3_128(payload).hexdigest(),
                "bytes": len(payload),
                "micro_batches": len(decoded),
            }
            if rows is not None:
                line["rows"] = rows
            out.write(json.dumps(line) + "\n")
            out.flush()
            if args.train_seconds:
                time.sleep(args.train_seconds)
            announcer.trained_through(step)
            step += 1
            if args.steps is not None and step - args.start_step >= args.steps:
                break
    while announcer.announced < announcer.trained and announcer.enabled:
        time.sleep(0.1)  # paused: the last announcements wait for the resume
        announcer.flush()


def pause_file_of(record: str | Path) -> Path:
    return Path(f"{record}.pause")


def pause_announcements(record: str | Path) -> None:
    """From the test: rank 0 stops announcing policy versions (its training goes on)."""
    pause_file_of(record).touch()


def resume_announcements(record: str | Path) -> None:
    """From the test: rank 0 announces every version it held back, then goes on."""
    pause_file_of(record).unlink(missing_ok=True)


def read_record(record: str | Path) -> list[dict[str, Any]]:
    """What a peer received, in order (nothing yet: an empty list)."""
    path = Path(record)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stock_peer_command(
    transport: str,
    rank: int,
    record: str | Path,
    *,
    output_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    start_step: int = 1,
    steps: int | None = None,
    announce: bool = True,
    poll: float = POLL_SECONDS,
    train_seconds: float = 0.0,
    wire: str = DEFAULT_WIRE,
) -> list[str]:
    command = [
        sys.executable, "-m", "tests.support.stock_peers", transport,
        "--rank", str(rank), "--record", str(record), "--output-dir", str(output_dir),
        "--host", host, "--port", str(port), "--start-step", str(start_step),
        "--poll", str(poll), "--train-seconds", str(train_seconds),
    ]  # fmt: skip
    if steps is not None:
        command += ["--steps", str(steps)]
    if not announce:
        command.append("--no-announce")
    if wire != DEFAULT_WIRE:
        command += ["--wire", wire]
    return command


def start_stock_peer(transport: str, rank: int, record: str | Path, **options: Any) -> subprocess.Popen:
    """A peer as a subprocess of this one (kill it by its PID); output next to the record."""
    log = open(f"{record}.log", "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        stock_peer_command(transport, rank, record, **options),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def start_stock_ranks(
    settings: RunSettings, steps: Sequence[int | None], *, wire: str = DEFAULT_WIRE
) -> tuple[list[Path], list[subprocess.Popen]]:
    """A peer for every rank of the run, over its transport and from its start step, that
    exits after `steps[rank]` steps (None: reads until killed) and decodes as `wire`; their
    record files (`stock-rank-{rank}.jsonl` in the run's output directory) and processes."""
    records = [Path(settings.output_dir) / f"stock-rank-{rank}.jsonl" for rank in range(settings.ranks)]
    peers = [
        start_stock_peer(
            settings.transport, rank, record, output_dir=settings.output_dir, port=settings.zmq_port,
            start_step=settings.start_step, steps=steps[rank], wire=wire,
        )
        for rank, record in enumerate(records)
    ]  # fmt: skip
    return records, peers


def await_every_step(
    transport: str,
    peers: Sequence[subprocess.Popen],
    records: Sequence[Path],
    steps: int,
    timeout: float = 60.0,
) -> None:
    """Until every stock rank has `steps` steps: over files each exits once it has them; over
    ZMQ each reads until killed (a duplicate counts as a step to it), so its record is watched."""
    if transport == "fs":
        for peer in peers:
            assert peer.wait(timeout) == 0, f"every stock rank got its {steps} steps and exited"
        return
    deadline = time.monotonic() + timeout
    while any(len({r["topic_step"] for r in read_record(record)}) < steps for record in records):
        assert time.monotonic() < deadline, "every stock rank got every step"
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("transport", choices=("zmq", "fs"))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--record", required=True, help="JSON lines: one per received step")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--start-step", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="exit after this many steps")
    parser.add_argument("--no-announce", dest="announce", action="store_false")
    parser.add_argument("--poll", type=float, default=POLL_SECONDS)
    parser.add_argument("--train-seconds", type=float, default=0.0)
    parser.add_argument("--wire", choices=WIRES, default=DEFAULT_WIRE, help="the prime-rl trainer decoded as")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
