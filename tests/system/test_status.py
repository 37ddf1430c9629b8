"""Following a run from outside it: `rlship status` (its list and its live view) and the
orchestrator's Prometheus endpoint, against a real run.

The run ships over the filesystem with the builtin trainer ranks started late: the policy
gate lets the first steps through and then holds the run, which stays `running` with a
known number of steps shipped until the ranks start. What the status and the scrape say is
checked there, and after the run, against what the run left: its `metrics.jsonl` and the
payload files the ship worker wrote for each rank."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from orchestrator.settings import RunSettings
from tests.support.processes import REPO, Workers, python_command, wait_for
from tests.support.prometheus import scrape
from tests.support.shiprun import ShipResult, ship, ship_settings, start_trainers, stop
from transport.keys import RunKeys
from transport.zmq_sockets import free_port_pair

STEPS = 4


def shipped_files(settings: RunSettings) -> int:
    """Steps whose payload file the ship worker wrote for every rank (the fs transport)."""
    steps = Path(settings.output_dir, "rollouts").glob("step_*")
    return sum(all((step / f"rank_{r}.bin").exists() for r in range(settings.ranks)) for step in steps)


def metrics_lines(settings: RunSettings) -> int:
    path = Path(settings.output_dir, "metrics.jsonl")
    return len(path.read_text().splitlines()) if path.exists() else 0


@contextlib.contextmanager
def held_run(settings: RunSettings, client: redis.Redis) -> Iterator[list[ShipResult]]:
    """The run, on a thread, held by the policy gate (no rank acknowledges) once the steps
    it lets through are shipped; the ranks start when the block ends, and the run with them."""
    results: list[ShipResult] = []
    thread = threading.Thread(target=lambda: results.append(ship(settings, trainers=False)))
    thread.start()
    state = RunKeys(settings.run_id)

    def held() -> bool:
        status = client.hgetall(state.status)
        cut = int(status.get(b"next_step", 0)) - settings.start_step
        return b"stalled_ranks" in status and cut > 0 and client.hlen(state.published) == cut

    try:
        wait_for("the policy gate to hold the run", held, timeout=120)
        mirrored = lambda: metrics_lines(settings) == shipped_files(settings)  # noqa: E731
        wait_for("metrics.jsonl to have every record", mirrored, timeout=60)
        yield results
    finally:
        ranks = start_trainers(settings)
        thread.join(180)
        stop(ranks)
    assert results and results[0].summary["steps_shipped"] == settings.steps


def rlship_status(settings: RunSettings, *args: str) -> str:
    process = subprocess.run(
        python_command("status", *args, "--redis-url", settings.redis_url),
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr
    return process.stdout


def listed(settings: RunSettings) -> tuple[str, int, int]:
    """The run's state and `shipped/steps` in `rlship status`'s list."""
    rows = json.loads(rlship_status(settings, "--json"))
    row = next(row for row in rows if row["run_id"] == settings.run_id)
    return row["state"], row["shipped"], row["steps"]


def fs_settings(run_id: str, redis_url: str, workers: Workers, tmp_path: Path, **overrides) -> RunSettings:
    return ship_settings(run_id, redis_url, workers, tmp_path / "run", steps=STEPS, transport="fs",
                         max_async_level=1, **overrides)  # fmt: skip


@pytest.mark.timeout(300)
def test_status_follows_a_run(
    workers: Workers, client: redis.Redis, run_id: str, redis_url: str, tmp_path: Path
) -> None:
    settings = fs_settings(run_id, redis_url, workers, tmp_path)
    with held_run(settings, client):
        shipped = shipped_files(settings)
        assert 0 < shipped < STEPS
        assert listed(settings) == ("running", shipped, STEPS)
        frame = rlship_status(settings, run_id)  # one frame, and it returns
        assert re.search(rf"^{run_id} +running +{shipped}/{STEPS} ", frame, re.MULTILINE), frame
        assert f" {shipped}/{STEPS} shipped, {shipped} cut " in frame, frame
        assert "policy gate waits on rank(s) [0, 1]" in frame, frame
        plain = rlship_status(settings)  # the list, as a person reads it
        assert re.search(rf"^{run_id} +running +{shipped}/{STEPS} ", plain, re.MULTILINE), plain
        live = subprocess.Popen(
            python_command("status", run_id, "--follow", "--redis-url", settings.redis_url),
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        # The run goes on only once the follower shows its first status: it follows from there.
        first = [live.stdout.readline()]
        while first[-1] and not first[-1].startswith("status: "):
            first.append(live.stdout.readline())
    try:
        rest, _ = live.communicate(timeout=120)  # it ends with the run
    finally:
        live.kill()
    followed = "".join(first) + rest
    assert live.returncode == 0, followed
    # The steps shipped while it followed, one line each as `rlship run` prints them, then
    # the final status (and each rank's last contact).
    step_lines = [line for line in followed.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in step_lines] == list(range(shipped, STEPS)), followed
    statuses = [line for line in followed.splitlines() if line.startswith("status: ")]
    assert f" {STEPS}/{STEPS} shipped, {STEPS} cut " in statuses[-1], followed
    assert shipped_files(settings) == metrics_lines(settings) == STEPS
    assert listed(settings) == ("finished", STEPS, STEPS)
    frame = rlship_status(settings, run_id, "--follow")  # a finished run: one frame, then it returns
    assert f" {STEPS}/{STEPS} shipped, {STEPS} cut " in frame, frame
    assert frame.count("status: ") == 1, f"the frame once: {frame}"
    status = {k.decode(): float(v) for k, v in client.hgetall(f"rlship:{run_id}:status").items()}
    published = [float(at) for at in client.hvals(f"rlship:{run_id}:published")]
    assert status["updated_at"] >= max(published), "the last status is written as the run ends"


def test_status_of_an_unknown_run_is_one_line(redis_url: str) -> None:
    process = subprocess.run(
        python_command("status", "no-such-run", "--redis-url", redis_url),
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert process.returncode == 2 and process.stdout == ""
    assert process.stderr.count("\n") == 1 and "holds no run 'no-such-run'" in process.stderr


@pytest.mark.timeout(300)
def test_prometheus_endpoint_during_a_run(
    workers: Workers, client: redis.Redis, run_id: str, redis_url: str, tmp_path: Path
) -> None:
    port = free_port_pair()
    settings = fs_settings(run_id, redis_url, workers, tmp_path, metrics_port=port)
    with held_run(settings, client):
        samples = scrape(port, run_id)
        shipped = shipped_files(settings)
        assert 0 < shipped < STEPS
        assert samples["rlship_steps_shipped_total"] == shipped == metrics_lines(settings)
        assert samples["rlship_records_total"] == shipped
        assert samples["rlship_steps_cut_total"] == shipped
        assert samples["rlship_steps_wanted"] == STEPS
        assert samples["rlship_stalled_ranks"] == settings.ranks
        arrived = float(client.hget(RunKeys(run_id).status, "arrived") or 0)
        assert samples["rlship_rollouts_arrived_total"] == arrived > 0  # the producer is held too
        # Nothing is in flight while the gate holds the run; the queues are empty.
        stages = {k: v for k, v in samples.items() if k.startswith("rlship_tasks_in_flight:")}
        assert len(stages) == 7 and set(stages.values()) == {0.0}, stages
        for queue in (workers.cpu_queue, workers.ship_queue):
            assert samples[f"rlship_queue_depth:{queue}"] == 0
        # Every shipped step's payloads stay in Redis until the ranks acknowledge them.
        files = Path(settings.output_dir, "rollouts").glob("step_*/rank_*.bin")
        payload_bytes = sum(path.stat().st_size for path in files)
        assert samples["rlship_payload_bytes"] == payload_bytes > 0
        # The byte budget's view: those payloads, and the rollouts Redis still holds.
        blobs = [k for k in client.scan_iter(match=RunKeys(run_id).rollout("*")) if not k.endswith(b":wire")]
        assert samples["rlship_held_bytes"] == payload_bytes + sum(client.strlen(k) for k in blobs)
        assert samples["rlship_event_loop_lag_max_seconds"] > 0
    with pytest.raises(OSError):  # the run is over: so is its endpoint
        scrape(port, run_id)
