"""Worker deaths in the middle of every stage: the task is delivered again and the step
completes; every rank receives every step once, in order, byte-identical to a run
without faults; one record per step; nothing left behind in Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings
from tasks.faults import arm, faults_key
from tasks.ship import RunState
from tests.conftest import Workers, running_workers
from tests.factories import group
from tests.shiprun import ship, ship_settings
from tests.test_ship_path import leftover_keys
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


def deterministic_run(client, run_id: str, redis_url: str, workers: Workers, tmp_path) -> RunSettings:
    """Rollouts written up front, all trainable and on-policy: every step's cohort, and so
    every payload, is the same in every run."""
    settings = ship_settings(
        run_id,
        redis_url,
        workers,
        tmp_path,
        steps=STEPS,
        batch_size=8,
        group_size=4,
        max_off_policy_steps=100,
    )
    producer = RolloutProducer(client, run_id)
    for index in range(STEPS * 2 + 2):
        producer.produce(group(f"d{index}", [1.0, 0.0, 1.0, 0.0], num_output_tokens=10 + index, env="math"))
    return settings


def delivered(client, run_id: str, ranks: int) -> tuple[dict[int, dict[int, str]], dict[int, dict[int, int]]]:
    keys = RunKeys(run_id)
    checksums = {
        r: {int(s): c.decode() for s, c in client.hgetall(keys.received(r)).items()} for r in range(ranks)
    }
    counts = {
        r: {int(s): int(n) for s, n in client.hgetall(keys.deliveries(r)).items()} for r in range(ranks)
    }
    return checksums, counts


@pytest.fixture(scope="module")
def fault_free(redis_url: str, faulty_workers: Workers, tmp_path_factory) -> dict[int, dict[int, str]]:
    import redis

    client = redis.Redis.from_url(redis_url)
    run_id = "fault-free-" + faulty_workers.cpu_queue
    settings = deterministic_run(
        client, run_id, redis_url, faulty_workers, tmp_path_factory.mktemp("fault-free")
    )
    ship(settings, produce=False)
    checksums, _ = delivered(client, run_id, settings.ranks)
    assert all(sorted(steps) == list(range(STEPS)) for steps in checksums.values())
    return checksums


@pytest.mark.parametrize("stage", STAGES)
def test_a_worker_killed_mid_stage_changes_nothing(
    stage, client, redis_url, run_id, faulty_workers, fault_free, tmp_path
):
    settings = deterministic_run(client, run_id, redis_url, faulty_workers, tmp_path)
    arm(client, run_id, stage, step=1, rank=1 if stage in PER_RANK else None)
    result = ship(settings, produce=False)

    assert client.hlen(faults_key(run_id)) == 0, "the armed fault fired"
    checksums, counts = delivered(client, run_id, settings.ranks)
    assert checksums == fault_free, "every rank got every step, byte-identical to the fault-free run"
    assert all(n == 1 for rank in counts.values() for n in rank.values()), f"delivered once: {counts}"
    assert [int(r["step"]) for r in result.records] == list(range(STEPS))
    assert client.xlen(RunKeys(run_id).metrics_stream) == STEPS, "one record per step"
    assert client.hlen(RunState(run_id).published) == STEPS
    assert leftover_keys(client, run_id) == []
