"""Resuming as a user does: Ctrl-C on `rlship run`, then the command its summary prints,
typed as printed (from another directory). The run goes on with its own settings and
output directory to the steps it was asked for; a resume that would change what its steps
were made with, or end it at or before what it shipped, stops in one line."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from orchestrator.settings import run_queue
from tests.support.processes import left_running, refused, wait_for
from transport.keys import RunKeys

STEPS = 60  # enough that Ctrl-C lands before the last step, on a loaded machine too
RUN_SECONDS = 240


def rlship_run(cwd: Path, redis_url: str, *args: str, **options) -> subprocess.Popen:
    """`rlship run ARGS` typed in `cwd`, its own process group (a terminal's foreground job)."""
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.commands.cli", "run", *args],
        cwd=cwd, env={**os.environ, "REDIS_URL": redis_url}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **options,
    )  # fmt: skip


def typed(cwd: Path, redis_url: str, command: str) -> subprocess.CompletedProcess:
    """A printed `rlship run ...` command, run as printed."""
    argv = shlex.split(command)
    assert argv[:2] == ["rlship", "run"], command
    run = rlship_run(cwd, redis_url, *argv[2:])
    output, _ = run.communicate(timeout=RUN_SECONDS)
    return subprocess.CompletedProcess(run.args, run.returncode, output, "")


@pytest.mark.timeout(RUN_SECONDS * 2)
def test_ctrl_c_then_the_printed_command_finishes_the_run_with_its_settings(client, redis_url, tmp_path):
    run_id = f"resume-{uuid.uuid4().hex[:6]}"
    first_dir, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first_dir.mkdir()
    elsewhere.mkdir()
    keys = RunKeys(run_id)
    try:
        small = ("--batch-size", "16", "--group-size", "4", "--seq-len", "512")
        run = rlship_run(first_dir, redis_url, "--steps", str(STEPS), "--run-id", run_id, *small)
        wait_for("three steps shipped", lambda: client.hlen(keys.published) >= 3, 120)
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C
        output, _ = run.communicate(timeout=RUN_SECONDS)
        shipped = client.hlen(keys.published)
        assert 3 <= shipped < STEPS, f"{shipped} shipped: Ctrl-C came too late to test a resume"
        step_lines = [line for line in output.splitlines() if line.startswith("step ")]
        assert len(step_lines) == shipped, "the terminal shows every step shipped before Ctrl-C"
        assert f"rlship run {run_id}: {shipped} steps shipped" in output
        assert left_running(run_id) == []
        queues = [run_queue(run_id, kind) for kind in ("cpu", "ship")]
        assert client.exists(*queues) == 0, "no task message of the run is left"
        printed = re.search(r"`(rlship run --run-id \S+)` resumes it", output)
        assert printed, output[-2000:]

        changed = typed(elsewhere, redis_url, f"{printed.group(1)} --ranks 3 --seq-len 1024")
        assert changed.returncode == 2
        refused(changed, "ranks: 2 in the run, 3 given", "seq_len: 512 in the run, 1024 given")
        too_few = typed(elsewhere, redis_url, f"{printed.group(1)} --steps {shipped}")
        assert too_few.returncode == 2
        refused(too_few, f"has shipped {shipped} steps; steps={shipped} would end it", f"above {shipped}")
        assert client.hlen(keys.published) == shipped and not client.exists(keys.finished)

        resumed = typed(elsewhere, redis_url, printed.group(1))
        assert resumed.returncode == 0, resumed.stdout[-3000:]
        assert (
            f"rlship run {run_id}: resuming with the run's settings, {shipped} of {STEPS} steps shipped"
            in (resumed.stdout)
        )
        assert f"{STEPS} steps shipped, {shipped} of them before this start" in resumed.stdout
        records = (first_dir / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in records] == list(range(STEPS)), "one output directory"
        assert not (elsewhere / "runs").exists()
        assert client.exists(keys.finished)
    finally:
        stale = list(client.scan_iter(match=f"{keys.prefix}*"))
        if stale:
            client.unlink(*stale)


def test_a_run_that_is_running_is_not_resumed_beside_itself(client: redis.Redis, redis_url, tmp_path):
    """A second `rlship run --run-id R` while R's orchestrator holds the lease would start a
    second ship worker on the run's ports and queue: refused in one line."""
    run_id = f"live-{uuid.uuid4().hex[:6]}"
    keys = RunKeys(run_id)
    client.set(keys.settings, json.dumps({"run_id": run_id, "steps": 5}), ex=60)
    client.set(keys.orchestrator_lease, "another-host:1:2", ex=60)
    try:
        done = typed(tmp_path, redis_url, f"rlship run --run-id {run_id}")
        assert done.returncode == 2
        refused(done, f"run {run_id} is running now (its orchestrator holds the lease)")
    finally:
        client.delete(keys.settings, keys.orchestrator_lease)
