"""Secrets are never printed: a Redis password given to the real `rlship` commands through
every error path (a setting refused alone or across settings, a Redis that does not answer,
a Redis that refuses the password) and through a whole run appears in none of their output,
nor in any file the run writes."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from orchestrator.commands.processes import celery_worker_command
from tests.support.processes import REPO, free_port, python_command, rlship
from transport.zmq_sockets import free_port_pair

PASSWORD = "s3cr3t-Pa55-" + uuid.uuid4().hex[:6]

COMMANDS = [
    ["run", "--steps", "1"],
    ["orchestrate"],
    ["produce", "--groups", "1"],
    ["trainer", "--rank", "0"],
    ["doctor"],
]


def shown(done: subprocess.CompletedProcess) -> str:
    """All the command printed; it must not hold the password or a traceback."""
    output = done.stdout + done.stderr
    assert PASSWORD not in output, output
    assert "Traceback" not in output, output
    return output


def run_id() -> str:
    return f"sec-{uuid.uuid4().hex[:8]}"


def test_a_setting_refused_across_settings_does_not_print_the_password(tmp_path: Path) -> None:
    """A check across settings (replay_steps against max_async_level) sees every value."""
    env = {"REDIS_URL": f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0", "RLSHIP_REPLAY_STEPS": "1"}
    # chaos and bench loop take their settings from the environment alone.
    others = [["config", "show"], ["chaos", "--json", str(tmp_path / "chaos.json")], ["bench", "loop"]]
    for command in [*[[*c, "--run-id", run_id()] for c in COMMANDS], *others]:
        done = rlship(*command, env=env)
        assert done.returncode != 0, command
        assert "replay_steps" in shown(done), command


def test_a_setting_refused_alone_does_not_print_the_password(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'redis_url = "http://user:{PASSWORD}@cache.internal:6379/0"\n')
    for command in [*COMMANDS, ["config", "show"]]:
        done = rlship(*command, "--config", str(config))
        assert done.returncode != 0, command
        assert "redis_url='http://user:***@cache.internal:6379/0'" in shown(done), command


def test_a_redis_that_does_not_answer_is_named_without_the_password() -> None:
    # Not 127.0.0.1: `rlship run` would start a Redis there instead.
    address = f"127.0.0.2:{free_port()}"
    for command in COMMANDS:
        done = rlship(*command, "--run-id", run_id(), "--redis-url", f"redis://:{PASSWORD}@{address}/0")
        assert done.returncode != 0, command
        assert f"redis://:***@{address}/0" in shown(done), command
    done = rlship("config", "show", "--redis-url", f"redis://:{PASSWORD}@{address}/0?password={PASSWORD}")
    assert done.returncode == 0
    assert f'redis_url = "redis://:***@{address}/0?password=***"' in shown(done)


def test_a_refused_password_is_not_printed(start_redis) -> None:
    address = start_redis("--requirepass", "the-right-one")
    for command in COMMANDS:
        done = rlship(*command, "--run-id", run_id(), "--redis-url", f"redis://:{PASSWORD}@{address}/0")
        assert done.returncode != 0, command
        assert "credentials" in shown(done), command


@pytest.mark.timeout(180)
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_run_on_a_redis_with_a_password_prints_and_writes_no_password(
    start_redis, tmp_path: Path, log_format: str
) -> None:
    """The password is right: the whole run (workers, trainer ranks, producer, orchestrator)
    uses it, and neither its terminal output nor any file it writes shows it."""
    address = start_redis("--requirepass", PASSWORD)
    output_dir = tmp_path / "run"
    command = [
        *python_command(), "run", "--steps", "1", "--ranks", "1",
        "--batch-size", "16", "--group-size", "4", "--seq-len", "512", "--zmq-port", str(free_port_pair()),
        "--run-id", run_id(), "--output-dir", str(output_dir),
        "--summary-json", str(output_dir / "summary.json"), *(["--log-json"] if log_format == "json" else []),
    ]  # fmt: skip
    env = {**os.environ, "REDIS_URL": f"redis://:{PASSWORD}@{address}/0"}
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 step shipped" in shown(done)
    written = [path for path in output_dir.rglob("*") if path.is_file()]
    assert any(path.name == "ship-worker.log" for path in written)
    for path in written:
        assert PASSWORD.encode() not in path.read_bytes(), path


def test_a_worker_refused_by_redis_does_not_print_the_password(start_redis, tmp_path: Path) -> None:
    """A worker started by hand with a wrong password says it cannot connect (and keeps
    trying); the lines it prints until then hold no password."""
    address = start_redis("--requirepass", "the-right-one")
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            celery_worker_command(f"cpu-{uuid.uuid4().hex[:8]}", 1, "refused@%h", None),
            env={**os.environ, "REDIS_URL": f"redis://:{PASSWORD}@{address}/0", "PYTHONPATH": str(REPO)},
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        while "Cannot connect" not in log.read_text(errors="replace") and worker.poll() is None:
            time.sleep(0.2)
    finally:
        worker.kill()
        worker.wait()
    text = log.read_text(errors="replace")
    assert "Cannot connect" in text and "invalid username-password" in text.lower(), text
    assert PASSWORD not in text, text
