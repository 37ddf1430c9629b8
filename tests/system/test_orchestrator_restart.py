"""The orchestrator killed (SIGKILL) mid-run and started again: it resumes from what Redis
holds (the checkpoint written with every cut), and the run is the one a fault-free run
ships: every step once per rank, byte-identical, one record per step, nothing lost."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.shiprun import (
    delivered,
    deterministic_run,
    leftover_keys,
    metrics_lines,
    ship,
    start_orchestrator,
    start_trainers,
    stop,
)
from transport.keys import RunKeys

pytestmark = pytest.mark.timeout(240)
STEPS = 6


@pytest.mark.parametrize(
    ("kill_after_published", "numbering"),
    [(1, {}), (3, {}), (1, {"first_step": 1, "start_step": 4})],
    ids=["after-1", "after-3", "after-1-resumed-at-4"],
)
def test_a_restarted_orchestrator_ships_what_a_fault_free_run_ships(
    kill_after_published, numbering, client, redis_url, run_id, workers, tmp_path
):
    fault_free = deterministic_run(client, run_id + "-ff", redis_url, workers, tmp_path / "ff", STEPS)
    fault_free = fault_free.with_changes(**numbering)
    ship(fault_free, produce=False)
    expected, _ = delivered(client, fault_free.run_id, fault_free.ranks)

    settings = deterministic_run(client, run_id, redis_url, workers, tmp_path / "run", STEPS)
    settings = settings.with_changes(**numbering)
    published = RunKeys(run_id).published
    log = tmp_path / "orchestrator.log"
    trainers = start_trainers(settings)
    try:
        first = start_orchestrator(settings, log)
        deadline = time.monotonic() + 60
        while client.hlen(published) < kill_after_published:
            assert first.poll() is None and time.monotonic() < deadline, "no step published"
            time.sleep(0.005)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert client.hlen(published) < STEPS, "killed mid-run"
        second = start_orchestrator(settings, log)
        assert second.wait(120) == 0
    finally:
        stop(trainers)

    checksums, counts = delivered(client, run_id, settings.ranks)
    assert checksums == expected, "every rank got every step, byte-identical to the fault-free run"
    assert all(n == 1 for rank in counts.values() for n in rank.values()), f"delivered once: {counts}"
    records = [int(r["step"]) for r in metrics_lines(settings)]
    assert records == list(settings.step_numbers), "metrics.jsonl holds each step once"
    assert client.xlen(RunKeys(run_id).metrics_stream) == STEPS, "one record per step"
    last = metrics_lines(settings)[-1]
    assert last["accounting/arrived"] == 4 * (2 * STEPS + 2), "every rollout counted once"
    assert "resumed" in log.read_text()
    assert leftover_keys(client, run_id) == []
