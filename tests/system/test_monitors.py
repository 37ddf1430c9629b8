"""Monitors and samples through the real path: metrics.jsonl, the Redis stream, W&B in
offline mode (no network), and the per-step sample files."""

from __future__ import annotations

import json

import pytest

from tests.support.processes import require_module
from tests.support.shiprun import metrics_lines, ship, ship_settings
from transport.keys import RunKeys

pytestmark = pytest.mark.timeout(240)


def test_records_reach_every_monitor_and_samples_are_written(client, redis_url, run_id, workers, tmp_path):
    wandb = require_module("wandb")
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=2, samples_per_step=3,
        wandb_project="rlship-test", wandb_mode="offline",
    )  # fmt: skip
    result = ship(settings)

    lines = metrics_lines(settings)
    stream = [json.loads(fields[b"record"]) for _, fields in client.xrange(RunKeys(run_id).metrics_stream)]
    assert lines == stream == result.records
    assert [line["step"] for line in lines] == [0.0, 1.0]

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"one offline W&B run (wandb {wandb.__version__})"
    history = b"".join(path.read_bytes() for path in runs[0].glob("*.wandb"))
    assert (
        b"train/agg/effective/agent/reward/mean" in history and b"train/agg/all/agent/reward/p90" in history
    )

    for step in (0, 1):
        samples = [
            json.loads(line)
            for line in (tmp_path / "samples" / f"step_{step}.jsonl").read_text().splitlines()
        ]
        assert len(samples) == 3
        for sample in samples:
            assert len(sample["input_ids"]) == len(sample["loss_mask"]) > 0
            assert sample["step"] == step
