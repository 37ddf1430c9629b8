"""The exit-status table (docs/troubleshooting.md), held to what the commands do: each row's
example is run as written (a command), or the test it names must assert that status."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.processes import REPO
from transport.keys import RunKeys

ROW = re.compile(r"^\| (\d+) \| (.+) \| (.+) \|$", re.MULTILINE)


def table() -> dict[int, str]:
    """status -> its example, from the "Exit status" section."""
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    section = page[page.index("## Exit status") :]
    section = section[: section.index("\n\n**")]
    return {int(status): example for status, _, example in ROW.findall(section)}


def test_the_table_has_every_status_the_commands_use() -> None:
    assert sorted(table()) == [0, 1, 2, 3, 4, 130]


@pytest.mark.parametrize("status", [0, 1, 2])
def test_a_rows_example_command_exits_with_its_status(status: int, redis_url: str, tmp_path: Path) -> None:
    example = table()[status]
    command = re.fullmatch(r"`(rlship [^`]+)`", example)
    assert command, f"the example of {status} is a command: {example}"
    argv = shlex.split(command.group(1))
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.commands.cli", *argv[1:]],
        cwd=tmp_path, env={**os.environ, "REDIS_URL": redis_url}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == status, (argv, done.stdout[-1000:], done.stderr[-1000:])
    if status == 2:
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists(), "a refused or read-only command makes no directory"


@pytest.mark.parametrize("status", [3, 4])
def test_a_rows_named_test_asserts_its_status(status: int) -> None:
    path = re.match(r"`(tests/system/\w+\.py)`", table()[status])
    assert path, table()[status]
    assert f"returncode == {status}" in (REPO / path.group(1)).read_text()


def test_an_interrupted_command_exits_130(redis_url: str, tmp_path: Path, client) -> None:
    assert "`rlship orchestrate`" in table()[130] and "Ctrl-C" in table()[130]
    run_id = f"exit-{uuid.uuid4().hex[:6]}"
    orchestrator = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.commands.cli", "orchestrate", "--run-id", run_id,
         "--output-dir", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "REDIS_URL": redis_url}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not client.exists(RunKeys(run_id).status) and time.monotonic() < deadline:
            time.sleep(0.1)
        orchestrator.send_signal(signal.SIGINT)
        _, stderr = orchestrator.communicate(timeout=30)
        assert orchestrator.returncode == 130, stderr[-1000:]
        assert f"run {run_id} interrupted" in stderr
    finally:
        if orchestrator.poll() is None:
            orchestrator.kill()
        keys = list(client.scan_iter(match=f"{RunKeys(run_id).prefix}*"))
        claims = [
            key for key in client.scan_iter(match="rlship::port:*") if client.get(key) == run_id.encode()
        ]
        if keys or claims:
            client.unlink(*keys, *claims)
