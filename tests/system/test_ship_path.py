"""The ship path end to end: real Redis, real Celery worker processes, real trainer rank
processes over ZMQ and over files, the orchestrator on this test's event loop."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from tasks.stages.publish import conservation_error
from tests.support.shiprun import leftover_keys, metrics_lines, ship, ship_settings
from transport.keys import RunKeys

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("transport", ["zmq", "fs"])
def test_every_step_reaches_every_rank_once_in_order(transport, client, redis_url, run_id, workers, tmp_path):
    settings = ship_settings(  # rlship-1: progress/rollouts and `count` count the shipped
        run_id, redis_url, workers, tmp_path, transport=transport, steps=4, record_names="rlship-1"
    )
    result = ship(settings)
    keys = RunKeys(run_id)

    assert [int(r["step"]) for r in result.records] == [0, 1, 2, 3]
    assert client.xlen(keys.metrics_stream) == 4, "exactly one record per step"
    assert [int(r["step"]) for r in metrics_lines(settings)] == [0, 1, 2, 3]

    sent = {k.decode(): v.decode() for k, v in client.hgetall(RunKeys(run_id).sent_checksums).items()}
    for rank in range(settings.ranks):
        received = {int(k): v.decode() for k, v in client.hgetall(keys.received(rank)).items()}
        assert sorted(received) == [0, 1, 2, 3]
        for step, checksum in received.items():
            assert checksum == sent[f"{step}:{rank}"], f"rank {rank} step {step}: received != encoded"
    assert int(client.get(keys.policy_version)) == 4

    for record in result.records:
        assert record["progress/rollouts"] == settings.batch_size
        assert record["train/agg/effective/count"] == settings.batch_size
    assert leftover_keys(client, run_id) == [], "every payload and step key released"
    assert result.summary["steps_shipped"] == 4


def test_orchestrator_process_runs_no_stage(client, redis_url, run_id, workers, tmp_path):
    settings = ship_settings(run_id, redis_url, workers, tmp_path, steps=2)
    ship(settings)
    calls = {k.decode(): int(v) for k, v in client.hgetall(RunKeys(run_id).stage_calls).items()}
    me = f"{socket.gethostname()}:{os.getpid()}:"
    stages = {key.rsplit(":", 1)[1] for key in calls}
    assert {"finalize", "prune", "metrics", "pack", "encode", "release"} <= stages
    assert not [key for key in calls if key.startswith(me)], "the orchestrator's process ran a stage"
    per_stage: dict[str, int] = {}
    for key, count in calls.items():
        per_stage[key.rsplit(":", 1)[1]] = per_stage.get(key.rsplit(":", 1)[1], 0) + count
    assert per_stage["finalize"] == 2 and per_stage["encode"] == 2 * settings.ranks


def test_record_counts_discarded_rollouts_in_all(client, redis_url, run_id, workers, tmp_path):
    settings = ship_settings(  # rlship-1: its `count` of each subset
        run_id, redis_url, workers, tmp_path, steps=2, batch_size=24, record_names="rlship-1"
    )
    result = ship(settings)
    first = result.records[0]
    discarded = {k.split("/")[-1]: v for k, v in first.items() if k.startswith("accounting/discarded/")}
    assert discarded.get("zero_advantage", 0) > 0, "the synthetic workload has zero-advantage groups"
    # `all` holds every rollout finalized in the window, trainable or not.
    assert first["train/agg/all/count"] > first["train/agg/effective/count"]
    assert 0 < first["train/agg/all/is_trainable/mean"] < 1
    # Conservation: every rollout that arrived is rejected, discarded, shipped, dropped by
    # a worker, pending or in an open group, and the finalizer checked it.
    for record in result.records:
        assert conservation_error(record) is None and record["accounting/balanced"] == 1.0
    np.testing.assert_allclose(
        sum(r["progress/rollouts"] for r in result.records), result.records[-1]["progress/total_rollouts"]
    )
