"""A run's files on disk (issue 38): created for the run only, refused when another user
could have written them, and a full disk that stops the run in one line and loses nothing.

Real `rlship run`s, files, Redis and workers. The full-disk tests mount a size-limited tmpfs
(root), fill it with a run, enlarge it and finish the run with the command it printed."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.support.factories import payload
from tests.support.processes import REPO, python_command, refused, require, rlship, session_queue, signal_when
from transport.filesystem import FileReceiver, FileSender
from transport.keys import RunKeys
from transport.run_files import RefusedFile
from transport.zmq_sockets import free_port_pair

MODES = {"owner": (0o700, 0o600), "group": (0o750, 0o640)}


def run_command(run_id: str, output_dir: Path, *more: str) -> list[str]:
    return [
        "run", "--run-id", run_id, "--output-dir", str(output_dir), "--ranks", "2",
        "--batch-size", "16", "--group-size", "4", "--seq-len", "512",
        "--zmq-port", str(free_port_pair()),
        "--cpu-queue", session_queue(f"cpu-{run_id}"), "--ship-queue", session_queue(f"ship-{run_id}"),
        *more,
    ]  # fmt: skip


def wrong_modes(root: Path, directories: int, files: int) -> dict[str, str]:
    """Every directory and file under `root` (itself included) whose mode is not the one given."""
    wrong = {}
    for path in [root, *root.rglob("*")]:
        want = directories if path.is_dir() else files
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode != want:
            wrong[str(path.relative_to(root))] = f"{mode:04o}"
    return wrong


@pytest.mark.parametrize("file_mode", ["owner", "group"])
def test_a_runs_directories_and_files_are_its_owners_or_its_groups(redis_url, tmp_path, file_mode):
    """Files over the fs transport, payloads in a directory, rows files by handle: every
    directory and file the run leaves (logs, samples, metrics.jsonl, rank files, the payload
    root and directory) has the mode of `file_mode`, whatever the caller's umask."""
    run_id = f"files-{uuid.uuid4().hex[:8]}"
    output_dir = tmp_path / "run"
    command = run_command(
        run_id, output_dir, "--steps", "2", "--transport", "fs", "--workload", "moe",
        "--payload-store", "dir", "--file-mode", file_mode,
    )  # fmt: skip
    previous = os.umask(0o002)  # a permissive caller: the run's mode does not depend on it
    try:
        done = rlship(*command, env={"REDIS_URL": redis_url}, timeout=120)
    finally:
        os.umask(previous)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    made = {path.relative_to(output_dir).parts[0] for path in output_dir.iterdir()}
    assert {"logs", "samples", "metrics.jsonl", "rollouts", "payloads", "step-payloads"} <= made, made
    assert list((output_dir / "rollouts").rglob("rank_*.bin")), "the rank files are there"
    assert wrong_modes(output_dir, *MODES[file_mode]) == {}


def test_a_world_writable_rank_file_is_refused_by_the_receiver(redis_url, run_id, tmp_path):
    """A rank file another user could have replaced is not read: the receiver raises naming
    it and its mode, and `rlship trainer` ends in one line; the same file made the run's own
    again is read."""
    FileSender(tmp_path, run_id=run_id).send(0, 0, b"step 0")
    path = tmp_path / "rollouts" / "step_0" / "rank_0.bin"
    path.chmod(0o666)
    receiver = FileReceiver(tmp_path, 0, run_id=run_id, next_step=0)
    with pytest.raises(RefusedFile, match=re.escape(f"{path} is world-writable (mode 0666): refused")):
        receiver.receive(timeout=1)
    done = rlship(
        "trainer", "--rank", "0", "--run-id", run_id, "--transport", "fs", "--output-dir", str(tmp_path),
        "--steps", "1", env={"REDIS_URL": redis_url},
    )  # fmt: skip
    assert "world-writable (mode 0666)" in refused(done, str(path))
    path.chmod(0o600)
    assert receiver.receive(timeout=1).payload == b"step 0"


def test_a_trainer_rank_says_why_it_stops(client, redis_url, run_id, tmp_path):
    """A rank stops without an error when it has its steps, waited its idle timeout or is sent
    SIGTERM: its log says which (a rank given fewer steps than its run's would otherwise leave
    silently)."""
    sender = FileSender(tmp_path, run_id=run_id)
    for step in (0, 1):
        sender.send(step, 0, payload(step))
    env = {"REDIS_URL": redis_url}
    common = ["trainer", "--rank", "0", "--run-id", run_id, "--transport", "fs"]
    common += ["--output-dir", str(tmp_path)]
    done = rlship(*common, "--steps", "2", env=env)
    assert done.returncode == 0, done.stderr
    assert "rank 0 stops: the 2 steps it was given are received" in done.stderr + done.stdout
    idle = rlship(*common, "--start-step", "2", "--steps", "2", "--idle-timeout", "1", env=env)
    assert idle.returncode == 0, idle.stderr
    assert "rank 0 stops: no step for 1 s (its idle timeout)" in idle.stderr + idle.stdout
    # Waiting for a step that never comes, it is stopped by SIGTERM once its idle time is in
    # Redis (its handler is set by then): it says so and exits 0.
    waiting = subprocess.Popen(
        python_command(*common, "--start-step", "2", "--steps", "2"),
        env={**os.environ, **env}, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    client.delete(RunKeys(run_id).trainer_idle)
    idle_noted = lambda: client.hexists(RunKeys(run_id).trainer_idle, "0")  # noqa: E731
    stdout, stderr = signal_when(waiting, "the rank's idle time", idle_noted, signal.SIGTERM, timeout=10)
    assert waiting.returncode == 0, stderr
    assert "rank 0 stops: asked to (SIGTERM)" in stderr + stdout


# --- a full disk --------------------------------------------------------------------------


def mount_tmpfs(directory: Path, size: str) -> None:
    require("root, to mount a size-limited tmpfs", None if os.geteuid() == 0 else "not running as root")
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    require("mount -t tmpfs", mounted.stderr.strip() or None if mounted.returncode else None)


class StopClock:
    """When the run's stop was asked for (its `ship_fatal` line, written at the failing write)
    and when its orchestrator let go of the run after that: polled from Redis."""

    def __init__(self, client, run_id: str) -> None:
        self.client, self.keys = client, RunKeys(run_id)
        self.asked: float | None = None
        self.stopped: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.is_set() and self.stopped is None:
            now = time.monotonic()
            if self.asked is None and self.client.exists(self.keys.ship_fatal):
                self.asked = now
            elif self.asked is not None and not self.client.exists(self.keys.orchestrator_lease):
                self.stopped = now
            time.sleep(0.05)

    def close(self) -> None:
        self._done.set()
        self._thread.join()


@pytest.mark.parametrize(
    ("what", "options", "where"),
    [
        ("payload root", ("--workload", "moe"), "payloads"),
        ("payload directory", ("--workload", "moe-inline", "--payload-store", "dir"), "step-payloads"),
    ],
)
def test_a_full_disk_stops_the_run_naming_it_and_the_printed_command_finishes_it(
    client, redis_url, tmp_path, what, options, where
):
    steps = 4
    run_id = f"full-{uuid.uuid4().hex[:8]}"
    output_dir = tmp_path / "run"
    disk = output_dir / where
    mount_tmpfs(disk, "1m")
    try:
        clock = StopClock(client, run_id)
        try:
            done = rlship(*run_command(run_id, output_dir, "--steps", str(steps), *options),
                          env={"REDIS_URL": redis_url}, timeout=90)  # fmt: skip
        finally:
            clock.close()
        output = done.stdout + done.stderr
        assert done.returncode == 1 and "Traceback" not in output, output[-3000:]
        stopped = [line for line in done.stdout.splitlines() if line.strip().startswith("stopped:")]
        assert len(stopped) == 1, output[-3000:]
        assert re.search(
            rf"no space to write {re.escape(str(disk))}/\S+ \([\d,]+ bytes needed", stopped[0]
        ), stopped[0]
        assert clock.asked is not None and clock.stopped is not None, (clock.asked, clock.stopped)
        assert clock.stopped - clock.asked <= 5.0, f"stopped {clock.stopped - clock.asked:.1f} s after"
        resume = re.search(r"`(rlship run --run-id \S+)`", stopped[0])
        assert resume is not None and resume[1] == f"rlship run --run-id {run_id}", stopped[0]
        # What the stop left on the full disk is the run's own, and kept for the resume.
        assert wrong_modes(disk, 0o700, 0o600) == {}

        subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)
        again = rlship(*resume[1].split()[1:], env={"REDIS_URL": redis_url}, timeout=90)
        assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
        assert f"rlship run {run_id}: resuming with the run's settings" in again.stdout
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
        assert [int(json.loads(line)["step"]) for line in lines] == list(range(steps)), "each step once"
        keys = RunKeys(run_id)
        assert client.hlen(keys.published) == steps
        for rank in range(2):
            assert sorted(int(s) for s in client.hkeys(keys.received(rank))) == list(range(steps))
        assert not client.exists(keys.ship_fatal), "the resumed run let go of the stop"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
