"""Samples: a few shipped rollouts per step, written whole (tokens, masks, reward) to
`{output_dir}/samples/step_{N}.jsonl` for people to read. Each rank's encoder makes the
lines of its chosen rollouts from the arrays it read anyway (the one read of them) and
publish writes the file before the record, so a release never empties it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tasks.cohort import Cohort
from transport.run_files import space_for


def choose_samples(shipped: int, count: int, step: int) -> list[int]:
    """`count` positions among the shipped rollouts, the same for every run of the step."""
    if count <= 0 or shipped == 0:
        return []
    rng = np.random.default_rng(step)
    return sorted(int(i) for i in rng.choice(shipped, size=min(count, shipped), replace=False))


def sample_lines(
    step: int, cohort: Cohort, positions: list[int], arrays: Mapping[str, Mapping[str, np.ndarray]]
) -> list[dict[str, Any]]:
    lines = []
    for i in positions:
        rollout_id = cohort.labels["rollout_id"][i]
        payload = arrays[rollout_id]
        lines.append(
            {
                "step": step,
                "rollout_id": rollout_id,
                "env": cohort.labels["env"][i],
                "task_id": cohort.labels["task_id"][i],
                "reward": float(cohort.numeric["reward"][i]),
                "advantage": float(cohort.numeric["advantage"][i]),
                "input_ids": payload["input_ids"].tolist(),
                "loss_mask": payload["loss_mask"].tolist(),
            }
        )
    return lines


def write_samples(output_dir: Path, step: int, lines: list[dict[str, Any]]) -> Path:
    """Write atomically (temporary name, then rename): a reader never sees half a file;
    `DiskFull` without room for it (nothing is left)."""
    path = output_dir / "samples" / f"step_{step}.jsonl"
    temporary = path.with_suffix(f".tmp.{os.getpid()}")
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with space_for(path, len(text)):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            temporary.write_bytes(text)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    return path
