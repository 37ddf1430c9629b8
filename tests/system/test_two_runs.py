"""Two runs on one host and one Redis, started as a user starts them (`rlship run` with the
default settings): neither takes the other's tasks, ports or steps, a second run on a
port the first holds stops at once in one line, and a trainer of one run pointed at the
other's port is noticed, never silently trained.

The oracles are independent of the code under test: what each rank received is compared
with the checksums its own run sent (the runs have different seeds, so their payloads
differ); which workers took a run's tasks is the worker's node name, set by the command
line that started it; what a stock-behaving rank got is its own record file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from orchestrator.settings import run_queue
from tests.support.processes import left_running, python_command, refused, rlship, wait_for
from tests.support.stock_peers import read_record, start_stock_peer
from transport.keys import RunKeys, ship_port_claim_pattern
from transport.port_claims import port_claims

SMALL = ("--ranks", "2", "--batch-size", "16", "--group-size", "4", "--seq-len", "512")
RUN_SECONDS = 240


def start_run(directory: Path, redis_url: str, *args: str) -> subprocess.Popen:
    """`rlship run` as typed in `directory` (its default output directory is under it), in
    a process group of its own, as a terminal's foreground job (Ctrl-C signals the group)."""
    directory.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.commands.cli", "run", *SMALL, *args,
         "--summary-json", str(directory / "summary.json")],
        cwd=directory, env={**os.environ, "REDIS_URL": redis_url}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(run: subprocess.Popen, directory: Path) -> tuple[str, dict[str, Any]]:
    output, _ = run.communicate(timeout=RUN_SECONDS)
    assert run.returncode == 0, output[-3000:]
    return output, json.loads((directory / "summary.json").read_text())


def assert_left_nothing(client: redis.Redis, run_id: str) -> None:
    """No process, no key without an expiry, no queue, no binding, no port claim of the run."""
    assert left_running(run_id) == [], f"processes of {run_id} still running"
    unexpiring = [k for k in client.scan_iter(match=f"{RunKeys(run_id).prefix}*") if client.ttl(k) == -1]
    assert unexpiring == [], unexpiring
    queues = [run_queue(run_id, kind) for kind in ("cpu", "ship")]
    assert client.exists(*queues, *(f"_kombu.binding.{queue}" for queue in queues)) == 0
    assert [claim for claim in port_claims(client) if claim.run_id == run_id] == []


def delete_run(client: redis.Redis, run_id: str) -> None:
    """Every key of the run, and its port claims."""
    keys = list(client.scan_iter(match=f"{RunKeys(run_id).prefix}*"))
    claims = [
        k for k in client.scan_iter(match=ship_port_claim_pattern()) if client.get(k) == run_id.encode()
    ]
    if keys or claims:
        client.unlink(*keys, *claims)


@dataclass
class Started:
    """What a test started: `rlship run`s (process groups) and peers, and the run ids."""

    runs: list[subprocess.Popen] = field(default_factory=list)
    peers: list[subprocess.Popen] = field(default_factory=list)
    run_ids: set[str] = field(default_factory=set)
    summaries: list[Path] = field(default_factory=list)


@pytest.fixture
def started(client: redis.Redis):
    """Whatever the test's outcome: every process it started is ended by PID (a run with its
    whole group) and every key and port claim of its runs is deleted."""
    record = Started()
    yield record
    for peer in record.peers:
        peer.kill()
        peer.wait()
    for run in record.runs:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    for path in record.summaries:
        if path.exists():
            record.run_ids.add(json.loads(path.read_text())["run_id"])
    for run_id in record.run_ids:
        delete_run(client, run_id)


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_two_runs_with_default_settings_at_once_never_mix(client, redis_url, tmp_path, started):
    for name, seed in (("a", "1"), ("b", "2")):
        started.runs.append(start_run(tmp_path / name, redis_url, "--steps", "3", "--seed", seed))
        started.summaries.append(tmp_path / name / "summary.json")
    results = {name: finish(run, tmp_path / name) for name, run in zip("ab", started.runs, strict=True)}
    summaries = {name: summary for name, (_, summary) in results.items()}
    ids = {name: summary["run_id"] for name, summary in summaries.items()}
    assert ids["a"] != ids["b"]
    for name, summary in summaries.items():
        run_id, sent = ids[name], summary["sent_checksums"]
        assert summary["steps_shipped"] == 3 and summary["foreign_dropped"] == {}
        for rank in ("0", "1"):
            received = summary["ranks"][rank]
            assert received["steps"] == [0, 1, 2]
            assert received["checksums"] == [sent[f"{step}:{rank}"] for step in range(3)], (name, rank)
        assert summary["served_by"], "the run's tasks were taken by workers"
        for worker in summary["served_by"]:
            assert worker.startswith((f"cpu-{run_id}@", f"ship-{run_id}@")), (name, worker)
        assert_left_nothing(client, run_id)
    assert set(summaries["a"]["sent_checksums"].values()).isdisjoint(
        summaries["b"]["sent_checksums"].values()
    )
    ports = {name: summary["zmq_port"] for name, summary in summaries.items()}
    assert ports["a"] != ports["b"], "two runs never ship on the same ports"
    moved = [name for name, (output, _) in results.items() if "this run ships on" in output]
    assert moved, "a run left at the default port that another run holds moves, and says so"
    for name in moved:
        told = f"this run ships on {ports[name]} and {ports[name] + 1} (its trainer ranks are told)"
        assert told in results[name][0]


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_a_second_run_at_a_held_port_stops_at_once_and_foreign_ranks_are_noticed(
    client, redis_url, tmp_path, started
):
    """Run A ships; meanwhile run B is started on A's port (refused in one line, leaving
    nothing), and two trainers of run B are pointed at A's port: a stock-behaving one
    (prime-rl's receive: no run on the wire) and rlship's own. A's ranks get A's steps
    only; B's rlship rank trains nothing of A's and says so; A's ship worker warns of
    the second subscriber and of B's READY. Then A is stopped with Ctrl-C."""
    first, second = f"held-{uuid.uuid4().hex[:6]}", f"second-{uuid.uuid4().hex[:6]}"
    started.run_ids |= {first, second}
    run = start_run(tmp_path / "a", redis_url, "--steps", "1000", "--run-id", first)
    started.runs.append(run)

    def pair_claimed() -> list[int]:
        """Both ports of A's pair once claimed (a SCAN over many keys may see one of the two
        keys of a pair claimed while it runs)."""
        ports = sorted(c.port for c in port_claims(client) if c.run_id == first)
        return ports if len(ports) == 2 else []

    port = wait_for("run A's port claim", pair_claimed, 60)[0]
    wait_for("run A's first record", lambda: client.hlen(RunKeys(first).published) >= 1, 60)
    doctor = rlship("doctor", "--output-dir", str(tmp_path / "doctor"), env={"REDIS_URL": redis_url})
    listed = [line for line in doctor.stdout.splitlines() if "ZMQ ports held by live runs" in line]
    assert listed and f"run {first} on 127.0.0.1: {port}, {port + 1}" in listed[0], doctor.stdout

    done = rlship("run", "--steps", "2", "--run-id", second, "--zmq-port", str(port), "--output-dir",
                  str(tmp_path / "b"), env={"REDIS_URL": redis_url})  # fmt: skip
    assert done.returncode == 2
    refused(done, f"zmq_port 127.0.0.1:{port}", f"held by live run {first} of this Redis")
    assert_left_nothing(client, second)

    record = tmp_path / "stock-rank-0.jsonl"
    started.peers.append(
        start_stock_peer("zmq", 0, record, output_dir=tmp_path / "b", port=port, announce=False)
    )
    started.peers.append(subprocess.Popen(
        python_command("trainer", "--rank", "0", "--run-id", second, "--zmq-port", str(port),
                       "--output-dir", str(tmp_path / "b"), "--idle-timeout", "60", *SMALL),
        env={**os.environ, "REDIS_URL": redis_url}, stdout=(tmp_path / "b-rank-0.log").open("ab"),
        stderr=subprocess.STDOUT,
    ))  # fmt: skip
    wait_for("the stock rank to receive A's steps", lambda: len(read_record(record)) >= 2, 60)
    dropped = RunKeys(second).foreign_dropped
    wait_for("B's rlship rank to drop A's steps", lambda: int(client.hget(dropped, "0") or 0) >= 2, 60)
    published = client.hlen(RunKeys(first).published)
    wait_for("two more steps of A", lambda: client.hlen(RunKeys(first).published) >= published + 2, 60)
    os.killpg(run.pid, signal.SIGINT)  # Ctrl-C
    output, _ = run.communicate(timeout=60)

    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["stopped"].startswith("interrupted"), output[-2000:]
    sent = summary["sent_checksums"]
    for rank, received in summary["ranks"].items():
        assert received["checksums"] == [sent[f"{step}:{rank}"] for step in received["steps"]]
    assert client.hlen(RunKeys(second).received(0)) == 0, "B's rank trained none of A's steps"
    own = (tmp_path / "b-rank-0.log").read_text()
    assert f"rank 0 of run {second}: dropping step" in own and f"of run {first} from" in own
    ship_log = (tmp_path / "a" / "runs" / first / "logs" / "ship-worker.log").read_text()
    assert f"run {first}: rank 0 has 2 subscribers on tcp://127.0.0.1:{port}" in ship_log
    assert f"run {first}: ignoring READY of rank 0 of run {second}" in ship_log
    stock = read_record(record)
    assert all(line["topic"].endswith(f"|{first}") for line in stock), "the stock rank's copies name run A"
    assert_left_nothing(client, first)
