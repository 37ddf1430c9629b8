"""Hand-made rollouts for tests that need exact control over rewards and fates."""

from __future__ import annotations

import numpy as np

from orchestrator.records import RolloutRecord


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
