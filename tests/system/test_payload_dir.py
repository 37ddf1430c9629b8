"""`--payload-store dir`: per-rank payloads and the replay window in files, Redis holding
pointers. Against the real Redis and real files: a payload reads back through its pointer, a
file changed or gone is named, not passed on; the files go with their steps; and a run of
inline routed experts (prime-rl 559b447) ships every step whole with no payload in Redis."""

from __future__ import annotations

import json
import os
import re
import threading
import uuid

import pytest
import xxhash

from tests.support.processes import rlship, session_queue
from transport.arrays_blob import PayloadCorruptError
from transport.keys import RunKeys
from transport.payload_dir import payload_directory
from transport.replay import RetainedPayloads
from transport.store import PayloadStore
from transport.zmq_sockets import free_port_pair


def test_a_payload_reads_through_its_pointer_and_goes_with_its_step(client, run_id, tmp_path):
    store = PayloadStore(client, run_id)
    directory = payload_directory(tmp_path, run_id)
    payload = b"\x91\x90" + os.urandom(100_000)
    checksum = xxhash.xxh3_128(payload).hexdigest()
    store.put_payload(3, 1, payload, directory, checksum)
    stored = client.get(store.keys.payload(3, 1))
    assert len(stored) < 300 and payload not in stored, "Redis holds a pointer, not the bytes"
    assert directory.path(3, 1).read_bytes() == payload
    assert store.get_payload(3, 1) == payload
    assert RetainedPayloads(client, run_id).payload(3, 1) == payload, "a restarted rank replays it"

    directory.path(3, 1).write_bytes(payload[:-1] + b"\x00")  # same size, other bytes
    with pytest.raises(
        PayloadCorruptError, match=r"rank_1.bin: 100002 bytes, checksum [0-9a-f]{32}; written"
    ):
        store.get_payload(3, 1)
    store.release_payloads(ranks=2, through_step=3, evict_through=3, directory=directory)
    assert not (directory.root / "step_3").exists()
    assert not client.exists(store.keys.payload(3, 1))


@pytest.mark.timeout(300)
def test_a_run_of_inline_routed_experts_keeps_its_payloads_out_of_redis(redis_url, client, tmp_path):
    run_id = f"dir-{uuid.uuid4().hex[:8]}"
    keys = RunKeys(run_id)
    summary_path = tmp_path / "summary.json"
    command = [
        "run", "--steps", "4", "--ranks", "2", "--workload", "moe-inline",
        "--payload-store", "dir", "--batch-size", "16", "--group-size", "4", "--seq-len", "512",
        "--run-id", run_id, "--zmq-port", str(free_port_pair()), "--output-dir", str(tmp_path),
        "--cpu-queue", session_queue(f"cpu-{run_id}"), "--ship-queue", session_queue(f"ship-{run_id}"),
        "--summary-json", str(summary_path),
    ]  # fmt: skip
    largest = {"payload": 0, "rollout": 0}
    rank0_files: dict[int, int] = {}  # step -> size of rank 0's payload file
    done_event = threading.Event()

    def watch() -> None:
        """The largest payload and rollout values Redis holds for the run while it runs, and
        the sizes of rank 0's payload files."""
        while not done_event.is_set():
            for kind, pattern in (
                ("payload", f"{keys.steps_prefix}*:payload:*"),
                ("rollout", keys.rollout("*")),
            ):
                for key in client.scan_iter(match=pattern, count=1000):
                    largest[kind] = max(largest[kind], client.strlen(key))
            for step in range(4):
                path = tmp_path / "step-payloads" / run_id / f"step_{step}" / "rank_0.bin"
                if path.exists():
                    rank0_files[step] = path.stat().st_size
            done_event.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        done = rlship(*command, env={"REDIS_URL": redis_url}, timeout=240)
    finally:
        done_event.set()
        watcher.join()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps_shipped"] == 4
    sent = summary["sent_checksums"]
    for rank, received in summary["ranks"].items():
        assert received["steps"] == [0, 1, 2, 3]
        assert received["checksums"] == [sent[f"{step}:{rank}"] for step in received["steps"]]
    # Rank 0's payloads carry its tokens' routed experts inline (384 bytes a token, by the
    # tokens its trainer counted): in files; Redis holds pointers. The rollouts' blobs hold
    # their tokens, their routed experts waited in files.
    logged = (tmp_path / "logs" / "trainer-0.log").read_text()
    tokens = {
        int(m[0]): int(m[1])
        for m in re.findall(r"received step (\d+): \d+ micro-batches, (\d+) tokens", logged)
    }
    assert sorted(tokens) == [0, 1, 2, 3] and rank0_files, (tokens, rank0_files)
    for step, size in rank0_files.items():
        assert size > 384 * tokens[step], (step, size, tokens[step])
    assert 0 < largest["payload"] < 1024, largest
    assert 0 < largest["rollout"] < 64 * 1024, largest
    assert not (tmp_path / "step-payloads" / run_id).exists(), "the run's payload files went with it"
    assert not (tmp_path / "payloads" / run_id).exists(), "so did its rows files"
