"""However a run stops, no key of it is left without an expiry, no process of it is left,
its own queues go (or expire), and what it prints is true.

Real `rlship run` processes on the run's own queues, started in a session of their own (as
`setsid`, a supervisor or systemd would), stopped by SIGTERM, SIGINT or SIGKILL: to its
whole process group, to the `rlship run` process alone, to one child, or to every process
of the run at once; at start-up or mid-run. Throughout, the run's keys are looked at ten
times a second: one without an expiry, at any moment, is one a SIGKILL then would leave.
And a user's own producer killed mid-call leaves none either."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import psutil
import pytest

from tests.support.processes import REPO, python_command, signal_when, wait_for
from tests.support.runs import (
    forget_run,
    keys_without_expiry,
    own_queue_traces,
    run_command,
    wait_for_every_process_to_stop,
)
from transport.zmq_sockets import free_port_pair


@dataclass(frozen=True)
class Stop:
    target: str  # "group", "run" (the process alone), "everything", or a child's name
    signum: signal.Signals
    when: str  # "starting" (its orchestrator not yet under way) or "running" (steps published)
    says: str | None  # what `rlship run` says stopped it; None: it was killed and says nothing
    again: bool = False  # the signal sent twice, as an impatient Ctrl-C, Ctrl-C

    def __str__(self) -> str:
        return f"{self.signum.name}{'-twice' * self.again}-{self.target}-{self.when}"


STOPS = [
    Stop("group", signal.SIGTERM, "running", "interrupted (SIGTERM) while running"),
    Stop("group", signal.SIGINT, "running", "interrupted (SIGINT) while running", again=True),
    Stop("group", signal.SIGTERM, "starting", "interrupted (SIGTERM) while starting"),
    Stop("group", signal.SIGKILL, "running", None),
    Stop("run", signal.SIGINT, "starting", "interrupted (SIGINT) while starting"),
    Stop("run", signal.SIGKILL, "starting", None),
    Stop("everything", signal.SIGKILL, "running", None),
    Stop("orchestrator", signal.SIGTERM, "running", "the orchestrator exited with 130"),
    Stop("orchestrator", signal.SIGINT, "running", "the orchestrator exited with 130"),
    Stop("orchestrator", signal.SIGKILL, "running", "the orchestrator exited with -9"),
    Stop("producer", signal.SIGKILL, "running", "producer exited with -9"),
    # Restarted by `rlship run`, which goes on until the test stops it.
    Stop("cpu-worker", signal.SIGKILL, "running", "interrupted (SIGTERM) while running"),
]

CHILD_MARKERS = {"orchestrator": "orchestrate", "producer": "produce", "cpu-worker": "-n cpu-"}


def child(run: psutil.Process, name: str) -> psutil.Process | None:
    marker = CHILD_MARKERS[name]
    return next((p for p in run.children() if marker in " ".join(p.cmdline())), None)


def send(run: subprocess.Popen, stop: Stop) -> None:
    if stop.target == "group":
        os.killpg(run.pid, stop.signum)
    elif stop.target == "run":
        run.send_signal(stop.signum)
    elif stop.target == "everything":
        root = psutil.Process(run.pid)
        for process in [root, *root.children(recursive=True)]:
            process.send_signal(stop.signum)
    else:
        target = child(psutil.Process(run.pid), stop.target)
        assert target is not None, stop.target
        target.send_signal(stop.signum)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stop", STOPS, ids=str)
def test_a_stopped_run_leaves_every_key_expiring_and_says_where_it_was(client, redis_url, tmp_path, stop):
    run_id = f"stop-{uuid.uuid4().hex[:8]}"
    published = f"rlship:{run_id}:published"
    unexpiring: set[str] = set()

    def steps_published(count: int):
        """Waiting, look at the run's keys: none may be without an expiry at any moment."""
        unexpiring.update(keys_without_expiry(client, run_id))
        return client.hlen(published) >= count

    run = subprocess.Popen(
        run_command(run_id, 200, tmp_path, free_port_pair(), own_queues=True),
        env={**os.environ, "REDIS_URL": redis_url}, cwd=REPO, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        if stop.when == "starting":
            wait_for("the orchestrator started", lambda: child(psutil.Process(run.pid), "orchestrator"))
        else:
            wait_for("two steps published", lambda: steps_published(2), timeout=90)
        send(run, stop)
        if stop.again:
            time.sleep(0.5)
            send(run, stop)
        if stop.target == "cpu-worker":  # restarted: the run goes on, then is stopped
            before = client.hlen(published)
            wait_for("a step after the restart", lambda: steps_published(before + 1), 90)
            os.killpg(run.pid, signal.SIGTERM)
        stdout, _ = run.communicate(timeout=90)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    # A worker stopping on its own (its SIGTERM from the kernel) waits for its pool: under
    # load one was seen to take 40 s.
    wait_for_every_process_to_stop(run_id, 60)
    assert unexpiring == set()
    assert keys_without_expiry(client, run_id) == []
    logs = {path.name: path.read_text(errors="replace") for path in (tmp_path / "logs").glob("*.log")}
    assert {name: log for name, log in logs.items() if "Traceback" in log} == {}
    if stop.says is None:  # killed: it printed nothing; its queues expire
        assert run.returncode == -signal.SIGKILL
        assert set(own_queue_traces(client, run_id).values()) <= {"expires"}
    else:
        assert run.returncode == 1, stdout[-2000:]
        stopped = next(line for line in stdout.splitlines() if line.startswith("  stopped: "))
        assert stop.says in stopped, stopped
        resumes = f"`rlship run --run-id {run_id}` resumes it with its settings"
        assert resumes in stopped or (stop.when == "starting" and "the same command starts it" in stopped)
        assert own_queue_traces(client, run_id) == {}
    forget_run(client, run_id)


@pytest.mark.timeout(60)
def test_a_producer_of_a_users_script_killed_mid_call_leaves_every_key_expiring(client, redis_url):
    """A script of the user's own that writes rollouts as fast as it can, SIGKILLed: its
    writes are one Lua script each, which gives every key it writes an expiry."""
    run_id = f"stop-{uuid.uuid4().hex[:8]}"
    script = (
        "import itertools, redis, sys\n"
        "from orchestrator.producer import RolloutProducer\n"
        "from tests.support.factories import group\n"
        "producer = RolloutProducer(redis.Redis.from_url(sys.argv[1]), sys.argv[2])\n"
        "for index in itertools.count():\n"
        "    producer.produce(group(f'g{index}', [1.0, 0.0, 1.0, 0.0]))\n"
    )
    user = subprocess.Popen(
        [sys.executable, "-c", script, redis_url, run_id],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        wait_for("rollouts written", lambda: int(client.get(f"rlship:{run_id}:produced") or 0) >= 40)
        time.sleep(0.2)
        user.kill()
        user.wait(10)
        assert keys_without_expiry(client, run_id) == []
    finally:
        if user.poll() is None:
            user.kill()
            user.wait()
        forget_run(client, run_id)


@pytest.mark.timeout(60)
def test_rlship_produce_stopped_by_ctrl_c_says_one_line_and_leaves_every_key_expiring(client, redis_url):
    run_id = f"stop-{uuid.uuid4().hex[:8]}"
    produce = subprocess.Popen(
        [*python_command("produce"), "--run-id", run_id, "--batch-size", "16", "--group-size", "4",
         "--seq-len", "512"],
        env={**os.environ, "REDIS_URL": redis_url}, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    written = lambda: int(client.get(f"rlship:{run_id}:produced") or 0) >= 8  # noqa: E731
    stdout, stderr = signal_when(produce, "rollouts written", written, signal.SIGINT, timeout=30)
    assert produce.returncode == 130
    assert "Traceback" not in stdout + stderr, stderr
    assert stderr.splitlines()[-1] == "rlship produce: interrupted", stderr
    assert keys_without_expiry(client, run_id) == []
    forget_run(client, run_id)
