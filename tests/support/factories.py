"""Hand-made rollouts for tests that need exact control over rewards and fates."""

from __future__ import annotations

from typing import Any

import numpy as np

from orchestrator.records import RolloutRecord
from transport.arrays_blob import pack_arrays
from transport.codec import encode_microbatches
from transport.keys import RunKeys
from transport.schema import MicroBatch


def rollout(
    rollout_id: str,
    group_id: str,
    reward: float,
    *,
    env: str = "math",
    num_input_tokens: int = 4,
    num_output_tokens: int = 6,
    policy_version: int = 0,
    **fields,
) -> tuple[RolloutRecord, dict[str, np.ndarray]]:
    total = num_input_tokens + num_output_tokens
    record = RolloutRecord(
        rollout_id=rollout_id,
        group_id=group_id,
        task_id=f"task-{group_id}",
        env=env,
        policy_version=policy_version,
        reward=reward,
        num_input_tokens=num_input_tokens,
        num_output_tokens=num_output_tokens,
        **fields,
    )
    rng = np.random.default_rng(abs(hash(rollout_id)) % 2**32)
    arrays = {
        "input_ids": rng.integers(0, 1000, total).astype(np.int32),
        "loss_mask": np.arange(total) >= num_input_tokens,
        "inference_logprobs": -rng.random(total).astype(np.float32),
    }
    return record, arrays


def group(group_id: str, rewards: list[float], **fields) -> list[tuple[RolloutRecord, dict[str, np.ndarray]]]:
    return [rollout(f"{group_id}-r{i}", group_id, reward, **fields) for i, reward in enumerate(rewards)]


def make_batch(
    input_ids: Any,
    sample_lengths: list[int] | None = None,
    env_names: list[str] | None = None,
    floats: Any = None,
    **optional: Any,
) -> MicroBatch:
    """A valid micro-batch around `input_ids`; other per-token fields derived or given."""
    input_ids = np.asarray(input_ids, np.int64)
    n = len(input_ids)
    lengths = [n] if sample_lengths is None else sample_lengths
    floats = np.linspace(-3.0, 3.0, n) if floats is None else np.asarray(floats, np.float64)
    positions = np.concatenate([np.arange(length) for length in lengths]) if lengths else np.zeros(0)
    return MicroBatch(
        input_ids=input_ids,
        loss_mask=np.arange(n) % 3 == 0,
        advantages=floats,
        inference_logprobs=-np.abs(floats),
        position_ids=positions.astype(np.int64),
        sequence_lengths=lengths,
        temperatures=np.full(n, 0.7),
        env_names=env_names if env_names is not None else ["math"] * n,
        seq_lens=lengths,
        **optional,
    )


def payload(step: int) -> bytes:
    """A small valid payload for `step` (its length grows with the step)."""
    return bytes(encode_microbatches([make_batch(np.arange(step + 3))]))


def store_rollout_arrays(
    client: Any, run_id: str, rollouts: dict[str, dict[str, np.ndarray]], ttl_seconds: int = 600
) -> None:
    """Rollouts' arrays under their claim-check keys, as a producer's script writes them
    (once, with an expiry), for tests of what reads them."""
    keys = RunKeys(run_id)
    for rollout_id, arrays in rollouts.items():
        client.set(keys.rollout(rollout_id), pack_arrays(arrays), ex=ttl_seconds, nx=True)
