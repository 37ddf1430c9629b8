"""`rlship run` as a user runs it: one command that starts Redis-backed workers, trainer
ranks, the producer and the orchestrator, and ends with a summary."""

from __future__ import annotations

import json
import re
import subprocess
import uuid

import pytest

from tests.support.processes import REPO, python_command, rlship
from tests.support.reference import compare, reference_records
from tests.support.runs import run_arguments
from transport.zmq_sockets import free_port_pair


@pytest.mark.timeout(300)
def test_rlship_run_ships_every_step_to_every_rank(redis_url, tmp_path):
    run_id = f"cli-{uuid.uuid4().hex[:8]}"
    summary_path = tmp_path / "summary.json"
    done = rlship(
        *run_arguments(run_id, 3, tmp_path, free_port_pair()), "--ranks", "2",
        "--summary-json", str(summary_path), "--record-rollouts", str(tmp_path / "rollouts.jsonl"),
        "--log-json", env={"REDIS_URL": redis_url}, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [line for line in done.stdout.splitlines() if line.startswith("step ")][2].startswith("step 2 |")
    assert f"rlship run {run_id}: 3 steps shipped" in done.stdout
    # Not a terminal: plain lines, no cursor movement; the last status line says it all.
    assert "\x1b" not in done.stdout
    status = [line for line in done.stdout.splitlines() if line.startswith("status: ")]
    assert status[-1].startswith("status: steps [####################] 3/3 shipped")

    # --log-json reaches the children: the trainer ranks log JSON lines with their context.
    for rank in (0, 1):
        log_lines = (tmp_path / "logs" / f"trainer-{rank}.log").read_text().splitlines()
        entries = [json.loads(line) for line in log_lines]
        received = [e for e in entries if e["message"].startswith(f"rank {rank} received step")]
        assert len(received) == 3
        assert all(e["run_id"] == run_id and e["rank"] == rank for e in received)

    summary = json.loads(summary_path.read_text())
    assert summary["steps_shipped"] == 3
    # `rlship status` of the ended run shows the time and the worst loop lag the summary said.
    said = re.search(rf"rlship run {run_id}: .* in ([0-9.]+) s; event-loop lag max ([0-9.]+) ms", done.stdout)
    assert said, done.stdout[-1000:]
    frame = subprocess.run(
        python_command("status", run_id, "--redis-url", redis_url),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert frame.count("status: ") == 1 and f"3 cut | {said.group(1)} s |" in frame, (said.groups(), frame)
    assert f"ms now, {said.group(2)} ms max" in frame, (said.groups(), frame)
    for rank in ("0", "1"):
        received = summary["ranks"][rank]
        assert received["steps"] == [0, 1, 2]
        assert received["checksums"] == [summary["sent_checksums"][f"{s}:{rank}"] for s in range(3)]

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    keys = (
        "train/agg/effective/agent/reward/p90", "train/agg/effective/num_total_tokens/mean",
        "progress/total_tokens", "time/finalize", "time/ship", "time/wait_for_policy", "off_policy/max",
        "event_loop_lag/p99_ms", "accounting/balanced",
    )  # fmt: skip
    for key in keys:
        assert all(key in r for r in records), key
    shipped = sum(r["progress/input_tokens"] + r["progress/output_tokens"] for r in records)
    assert shipped == summary["tokens_shipped"]

    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    expected = reference_records(lines, records, first_step=0, names="prime-rl-559b447")
    for record in records:
        assert expected[int(record["step"])]["accounting/balanced"] == 1.0
        assert compare(record, expected[int(record["step"])]) == []
