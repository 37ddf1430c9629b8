"""Worker deaths in the middle of every stage: the task is delivered again and the step
completes; every rank receives every step once, in order, byte-identical to a run
without faults; one record per step; nothing left behind in Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks.faults import arm
from tests.support.processes import Workers, running_workers
from tests.support.shiprun import delivered, deterministic_run, leftover_keys, ship
from transport.keys import RunKeys

pytestmark = pytest.mark.timeout(180)

STEPS = 3
PER_RANK = ("encode", "send")
STAGES = ("finalize", "prune", "metrics", "pack", "encode", "send", "publish", "release")


@pytest.fixture(scope="module")
def faulty_workers(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """Workers that obey armed faults (RLSHIP_FAULTS=1), on queues of their own."""
    log_dir = tmp_path_factory.mktemp("faulty-worker-logs")
    with running_workers(redis_url, log_dir, env={"RLSHIP_FAULTS": "1"}) as pool:
        yield pool


@pytest.fixture(scope="module")
def fault_free(redis_url: str, faulty_workers: Workers, tmp_path_factory) -> dict[int, dict[int, str]]:
    import redis

    client = redis.Redis.from_url(redis_url)
    run_id = "fault-free-" + faulty_workers.cpu_queue
    settings = deterministic_run(
        client, run_id, redis_url, faulty_workers, tmp_path_factory.mktemp("fault-free"), STEPS
    )
    ship(settings, produce=False)
    checksums, _ = delivered(client, run_id, settings.ranks)
    assert all(sorted(steps) == list(range(STEPS)) for steps in checksums.values())
    return checksums


@pytest.mark.parametrize("stage", STAGES)
def test_a_worker_killed_mid_stage_changes_nothing(
    stage, client, redis_url, run_id, faulty_workers, fault_free, tmp_path
):
    settings = deterministic_run(client, run_id, redis_url, faulty_workers, tmp_path, STEPS)
    arm(client, run_id, stage, step=1, rank=1 if stage in PER_RANK else None)
    result = ship(settings, produce=False)

    assert client.hlen(RunKeys(run_id).faults) == 0, "the armed fault fired"
    checksums, counts = delivered(client, run_id, settings.ranks)
    assert checksums == fault_free, "every rank got every step, byte-identical to the fault-free run"
    assert all(n == 1 for rank in counts.values() for n in rank.values()), f"delivered once: {counts}"
    assert [int(r["step"]) for r in result.records] == list(range(STEPS))
    assert client.xlen(RunKeys(run_id).metrics_stream) == STEPS, "one record per step"
    assert client.hlen(RunKeys(run_id).published) == STEPS
    assert leftover_keys(client, run_id) == []
