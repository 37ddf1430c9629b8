"""The integrator's guide's example (examples/own_loop.py), run as docs/integrators.md says:
an inference loop of its own producing rollouts, rlship's workers and orchestrator started
as an operator starts them, and trainer ranks receiving through rlship's prime-rl-shaped
receivers or as stock prime-rl ones. The oracle for what arrived is the checksums encode
wrote against those the ranks acknowledged (rlship's receivers), and each rank's own count."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from orchestrator.settings import run_queue
from tests.support.processes import REPO, left_running
from tests.support.runs import forget_run
from transport.keys import RunKeys
from transport.zmq_sockets import free_port_pair

STEPS = 3


def run_example(
    script: str, run_id: str, redis_url: str, tmp_path: Path, *options: str
) -> subprocess.CompletedProcess:
    """examples/`script` run to its end as docs/integrators.md says: `STEPS` steps of run `run_id`."""
    example = [sys.executable, str(REPO / "examples" / script), "--steps", str(STEPS), *options,
               "--run-id", run_id, "--zmq-port", str(free_port_pair()),
               "--output-dir", str(tmp_path / "run")]  # fmt: skip
    env = {**os.environ, "REDIS_URL": redis_url}
    return subprocess.run(example, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("receivers", ["prime", "stock"])
def test_the_guides_example_delivers_every_step_to_every_rank(receivers, client, redis_url, tmp_path):
    run_id = f"guide-{receivers}-{uuid.uuid4().hex[:6]}"
    keys = RunKeys(run_id)
    try:
        done = run_example("own_loop.py", run_id, redis_url, tmp_path, "--receivers", receivers)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        for rank in (0, 1):
            assert f"rank {rank}: received steps [1, 2, 3]" in done.stdout
        assert f"own loop, run {run_id}: every rank got every step" in done.stdout
        assert client.hlen(keys.published) == STEPS
        sent = {k.decode(): v.decode() for k, v in client.hgetall(keys.sent_checksums).items()}
        assert sorted(sent) == [f"{step}:{rank}" for step in range(1, STEPS + 1) for rank in (0, 1)]
        if receivers == "prime":  # rlship's receivers acknowledge what they got, with its checksum
            for rank in (0, 1):
                got = {int(k): v.decode() for k, v in client.hgetall(keys.received(rank)).items()}
                assert got == {step: sent[f"{step}:{rank}"] for step in range(1, STEPS + 1)}
        assert left_running(run_id) == []
        queues = [run_queue(run_id, kind) for kind in ("cpu", "ship")]
        assert client.exists(*queues, *(f"_kombu.binding.{queue}" for queue in queues)) == 0, "no queue left"
    finally:
        forget_run(client, run_id)


@pytest.mark.timeout(300)
def test_the_verifiers_episodes_example_delivers_every_step(client, redis_url, tmp_path):
    """examples/verifiers_episodes.py: groups of verifiers episodes (msgpack, as environment
    servers send them) through EpisodeProducer to rlship's receivers."""
    pytest.importorskip("verifiers.v1")
    run_id = f"episodes-{uuid.uuid4().hex[:6]}"
    keys = RunKeys(run_id)
    try:
        done = run_example("verifiers_episodes.py", run_id, redis_url, tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        for rank in (0, 1):
            assert f"rank {rank}: received steps [1, 2, 3]" in done.stdout
        assert f"verifiers episodes, run {run_id}: every rank got every step" in done.stdout
        assert client.hlen(keys.published) == STEPS
        assert left_running(run_id) == []
    finally:
        forget_run(client, run_id)
