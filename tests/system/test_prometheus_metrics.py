"""The orchestrator's Prometheus endpoint as operators scrape it (issue 37's list, in
docs/metrics.md), against a real run: real workers, real trainer ranks, a real producer.

Scraped live, while the run ships, every metric is there; scraped again once the run has
ended (an endpoint served on the finished run's own components), each value is what an
independent source says: the records in metrics.jsonl, the `published` hash, Celery's own
task events, the workers the session started, the trainer ranks' processes, Redis' INFO
through a client of the test's own, the lag probe's count of samples."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from orchestrator.run_gauges import RunGauges
from orchestrator.settings import RunSettings
from tasks.faults import arm
from tasks.graph import STAGE_NAMES
from tests.support.celery_events import TaskStarts
from tests.support.processes import Workers, running_workers, wait_for
from tests.support.prometheus import exposition, run_samples, serve_finished_run
from tests.support.shiprun import ShipResult, metrics_lines, ship, ship_settings, start_trainers, stop
from transport.keys import RunKeys
from transport.zmq_sockets import free_port_pair

pytestmark = pytest.mark.timeout(300)

STEPS = 4
BUDGET = 1 << 30  # max_held_bytes: large enough never to hold the run back

# Every metric of docs/metrics.md's Prometheus section, by the name a scraper sees.
EXPECTED = (
    "rlship_stage_duration_seconds", "rlship_step_ship_duration_seconds", "rlship_queue_wait_seconds",
    "rlship_steps_shipped", "rlship_last_publish_timestamp_seconds", "rlship_trainer_idle_seconds",
    "rlship_rollouts_produced", "rlship_rollouts_released", "rlship_rollout_bytes_produced",
    "rlship_rollout_bytes_released", "rlship_held_bytes", "rlship_held_bytes_limit_bytes",
    "rlship_workers_up", "rlship_task_failures", "rlship_redis_memory_used_bytes",
    "rlship_redis_memory_max_bytes", "rlship_policy_staleness_steps", "rlship_policy_staleness_limit_steps",
    "rlship_event_loop_lag_seconds", "rlship_event_loop_lag_max_seconds", "rlship_queue_depth",
    "rlship_tasks_in_flight",
)  # fmt: skip


def values(samples, name: str, label: str | None = None) -> dict[str, float]:
    """A family's samples named `name`, by the value of `label` (or '' without one)."""
    return {(s.labels[label] if label else ""): s.value for s in samples if s.name == name}


def histogram(families, family: str, label: str | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """A histogram's counts and sums, by `label`."""
    samples = families[family]
    return values(samples, f"{family}_count", label), values(samples, f"{family}_sum", label)


def held(client: redis.Redis, keys: RunKeys) -> bool:
    """The policy gate holds the run: it waits on ranks, and every step cut is published
    and released."""
    status = client.hgetall(keys.status)
    cut = int(status.get(b"next_step", 0))
    return b"stalled_ranks" in status and cut > 0 and client.hlen(keys.released) == cut


def finished_endpoint_samples(result: ShipResult, settings, openmetrics: bool = False):
    """The endpoint served on the finished run's own components, scraped once the workers
    have been asked who consumes the run's queues."""
    endpoint, port = serve_finished_run(result.orchestrator, settings)
    try:
        wait_for("the workers' answer", lambda: endpoint.liveness.counts, timeout=30)
        return run_samples(port, settings.run_id, openmetrics), port, endpoint
    except BaseException:
        endpoint.close()
        raise


def test_every_metric_of_a_live_run_and_its_values_after(
    workers: Workers, client: redis.Redis, run_id: str, redis_url: str, tmp_path: Path
) -> None:
    port = free_port_pair()
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path / "run", steps=STEPS, metrics_port=port, max_held_bytes=BUDGET,
        transport="fs",  # the ship worker writes the steps without waiting for the late ranks
    )  # fmt: skip
    keys = RunKeys(run_id)
    events = TaskStarts(run_id)
    events.start()
    results: list[ShipResult] = []
    # The trainer ranks start late: the policy gate holds the run once the steps it lets
    # through are shipped and released, and the live scrape reads a run that stays put.
    run = threading.Thread(target=lambda: results.append(ship(settings, trainers=False)))
    run.start()
    ranks = []
    try:
        wait_for("the policy gate to hold the run", lambda: held(client, keys), timeout=120)
        # Every step released is observed once per stage (the orchestrator observes a step
        # when it sees it released: read until it has).
        expected = dict.fromkeys(STAGE_NAMES, client.hlen(keys.released))
        for _ in range(100):
            live = run_samples(port, run_id)
            counts, _ = histogram(live, "rlship_stage_duration_seconds", "stage")
            if counts == expected:
                break
            time.sleep(0.2)
        assert counts == expected, counts
        assert set(EXPECTED) <= set(live), sorted(set(EXPECTED) - set(live))
        produced, released = (values(live[f"rlship_rollouts_{kind}"], f"rlship_rollouts_{kind}_total")[""]
                              for kind in ("produced", "released"))  # fmt: skip
        assert produced >= released > 0
        openmetrics = exposition(port, openmetrics=True)
        assert "# TYPE rlship_stage_duration_seconds histogram" in openmetrics
        assert openmetrics.rstrip().endswith("# EOF")
    finally:
        ranks = start_trainers(settings)
        run.join(240)
        stop(ranks)
    assert results and results[0].summary["steps_shipped"] == STEPS
    records = metrics_lines(settings)
    assert len(records) == STEPS

    families, port, endpoint = finished_endpoint_samples(results[0], settings)
    try:
        # Stage seconds: one observation per stage per shipped step; the record's six timed
        # stages sum to what the records say (publish and release time themselves).
        counts, sums = histogram(families, "rlship_stage_duration_seconds", "stage")
        assert counts == dict.fromkeys(STAGE_NAMES, STEPS), counts
        for stage in ("finalize", "prune", "metrics", "pack", "encode", "send"):
            assert sums[stage] == pytest.approx(sum(r[f"time/{stage}"] for r in records)), stage
        assert all(sums[stage] > 0 for stage in ("publish", "release")), sums
        counts, sums = histogram(families, "rlship_step_ship_duration_seconds")
        assert counts == {"": STEPS} and sums[""] == pytest.approx(sum(r["time/ship"] for r in records))

        shipped = values(families["rlship_steps_shipped"], "rlship_steps_shipped_total")
        assert shipped == {"": len(records)}
        newest = max(float(at) for at in client.hvals(keys.published))
        assert values(families["rlship_last_publish_timestamp_seconds"],
                      "rlship_last_publish_timestamp_seconds") == {"": newest}  # fmt: skip

        # Produced against released: every rollout written was released by the run's end,
        # and the budget holds nothing.
        flows = {name: values(families[name], f"{name}_total")[""] for name in (
            "rlship_rollouts_produced", "rlship_rollouts_released",
            "rlship_rollout_bytes_produced", "rlship_rollout_bytes_released")}  # fmt: skip
        arrived = records[-1]["accounting/arrived"]
        assert flows["rlship_rollouts_produced"] == flows["rlship_rollouts_released"] >= arrived > 0, flows
        assert flows["rlship_rollout_bytes_produced"] == flows["rlship_rollout_bytes_released"] > 0, flows
        assert values(families["rlship_held_bytes"], "rlship_held_bytes") == {"": 0}
        assert values(families["rlship_held_bytes_limit_bytes"], "rlship_held_bytes_limit_bytes") == {
            "": BUDGET
        }

        # Queue waits: one per task delivery that started, as Celery's events count them
        # (the last of them may still be on their way: both are read until they agree).
        def waits_and_starts() -> tuple[dict[str, float], dict[str, int]]:
            waited, _ = histogram(run_samples(port, run_id), "rlship_queue_wait_seconds", "queue")
            started = events.counts()
            return waited, {
                "cpu": sum(started.values()) - started["rlship.send"],
                "ship": started["rlship.send"],
            }

        for _ in range(100):
            waited, started = waits_and_starts()
            if waited == started:
                break
            time.sleep(0.2)
        assert waited == started and started["cpu"] > STEPS * 7, (waited, events.counts())
        failures = values(families["rlship_task_failures"], "rlship_task_failures_total", "stage")
        assert failures == dict.fromkeys(STAGE_NAMES, 0), failures  # every stage, from 0

        idle = values(families["rlship_trainer_idle_seconds"], "rlship_trainer_idle_seconds_total", "rank")
        assert set(idle) == {"0", "1"} and all(seconds > 0 for seconds in idle.values()), idle
        assert values(families["rlship_workers_up"], "rlship_workers_up", "queue") == {"cpu": 1, "ship": 1}

        memory = redis.Redis.from_url(redis_url).info("memory")
        assert values(families["rlship_redis_memory_max_bytes"], "rlship_redis_memory_max_bytes") == {
            "": memory["maxmemory"]
        }
        assert values(families["rlship_redis_memory_used_bytes"], "rlship_redis_memory_used_bytes")[""] > 0

        staleness = values(families["rlship_policy_staleness_steps"], "rlship_policy_staleness_steps")
        assert staleness == {"": records[-1]["off_policy/max"]}
        limit = values(families["rlship_policy_staleness_limit_steps"], "rlship_policy_staleness_limit_steps")
        assert limit == {"": settings.max_off_policy_steps}

        counts, _ = histogram(families, "rlship_event_loop_lag_seconds")
        assert counts == {"": results[0].orchestrator.probe.samples} and counts[""] > 0
    finally:
        endpoint.close()
        events.stop()


@pytest.fixture(scope="module")
def faulty_workers(redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    """Workers that obey armed faults (RLSHIP_FAULTS=1), on queues of their own."""
    with running_workers(
        redis_url, tmp_path_factory.mktemp("faulty-logs"), env={"RLSHIP_FAULTS": "1"}
    ) as pool:
        yield pool


def test_a_worker_killed_mid_task_counts_one_failure_of_its_stage(
    faulty_workers: Workers, client: redis.Redis, run_id: str, redis_url: str, tmp_path: Path
) -> None:
    settings = ship_settings(run_id, redis_url, faulty_workers, tmp_path / "run", steps=2)
    arm(client, run_id, "pack", step=1)
    result = ship(settings)
    assert client.hlen(RunKeys(run_id).faults) == 0, "the armed fault fired"
    families, _, endpoint = finished_endpoint_samples(result, settings)
    endpoint.close()
    failures = values(families["rlship_task_failures"], "rlship_task_failures_total", "stage")
    assert failures == {**dict.fromkeys(STAGE_NAMES, 0), "pack": 1}, failures
    # The stage's seconds are still observed once per step: those of the delivery that marked it.
    counts, _ = histogram(families, "rlship_stage_duration_seconds", "stage")
    assert counts == dict.fromkeys(STAGE_NAMES, settings.steps), counts


def test_redis_memory_is_what_info_says(start_redis, tmp_path: Path) -> None:
    """On a Redis of the test's own, with a memory limit and no other client writing."""
    url = f"redis://{start_redis('--maxmemory', '64mb')}"
    settings = RunSettings(run_id="memory", redis_url=url, output_dir=tmp_path)
    gauges = RunGauges(redis.Redis.from_url(url), settings)
    info = redis.Redis.from_url(url)
    before = info.info("memory")["used_memory"]
    families = {family.name: family.samples for family in gauges.collect(newest_step=-1, newest_record=None)}
    after = info.info("memory")["used_memory"]
    assert values(families["rlship_redis_memory_max_bytes"], "rlship_redis_memory_max_bytes") == {
        "": 64 << 20
    }
    used = values(families["rlship_redis_memory_used_bytes"], "rlship_redis_memory_used_bytes")[""]
    assert min(before, after) - (64 << 10) <= used <= max(before, after) + (64 << 10), (before, used, after)


def test_a_task_that_raises_counts_one_failure_of_its_stage(
    faulty_workers: Workers, client: redis.Redis, run_id: str, redis_url: str, tmp_path: Path
) -> None:
    # The failed prune is acknowledged, not redelivered: the stall watchdog enqueues the step again.
    settings = ship_settings(run_id, redis_url, faulty_workers, tmp_path / "run", steps=2, stall_seconds=2.0)
    arm(client, run_id, "prune", step=1, how="raise")
    result = ship(settings)
    assert client.hlen(RunKeys(run_id).faults) == 0, "the armed fault fired"
    families, _, endpoint = finished_endpoint_samples(result, settings)
    endpoint.close()
    failures = values(families["rlship_task_failures"], "rlship_task_failures_total", "stage")
    assert failures == {**dict.fromkeys(STAGE_NAMES, 0), "prune": 1}, failures
