"""Proof of exactness: seeded scenarios through the real distributed path (Redis, Celery
workers, the filesystem transport), every record compared key by key with the plain
Python reference recomputed from the rollout log."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
import redis

from orchestrator.admission import AdmissionRefused
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings
from tests.support.factories import rollout
from tests.support.reference import check_advantages, compare, reference_records
from tests.support.shiprun import open_policy_gate, run_orchestrator, ship_settings
from transport.arrays_blob import pack_arrays
from transport.store import PayloadStore

SCENARIOS = 50
ENVS = ("math", "code", "chat")


def scenario_settings(seed: int, run_id: str, redis_url: str, workers, tmp_path) -> RunSettings:
    rng = np.random.default_rng(seed)
    return ship_settings(
        run_id, redis_url, workers, tmp_path,
        transport="fs", trainers="external", steps=int(rng.integers(1, 4)), ranks=int(rng.integers(1, 4)),
        batch_size=int(rng.integers(3, 13)), group_size=int(rng.integers(2, 6)),
        max_off_policy_steps=int(rng.integers(0, 3)), seq_len=64, max_async_level=int(rng.integers(0, 3)),
        record_rollouts=tmp_path / "rollouts.jsonl",
        record_names="rlship-1" if seed % 4 == 3 else "prime-rl-559b447",
    )  # fmt: skip


def produce_scenario(seed: int, settings: RunSettings, stop: threading.Event) -> None:
    """Seeded groups: several envs, binary and fractional rewards, errors, cancellations,
    old policy versions (stale), custom metrics, corrupt payloads and malformed records;
    written with small pauses so that windows and cuts interleave differently."""
    rng = np.random.default_rng(seed + 1000)
    client = redis.Redis.from_url(settings.redis_url)
    producer = RolloutProducer.for_run(client, settings, admitted=False)  # stale ones on purpose
    store = PayloadStore(client, settings.run_id)
    envs = ENVS[: int(rng.integers(1, 4))]
    error_rate, cancel_rate, corrupt_rate = (
        rng.choice([0, 0.05, 0.2]),
        rng.choice([0, 0.05]),
        rng.choice([0, 0.05]),
    )
    next_step = producer.keys.run_key("next_step")
    index = 0
    while not stop.is_set() and index < 400:
        # The policy a rollout was sampled with trails the step being filled by 0-2 steps
        # (the version on-policy for a step is the number of steps trained before it).
        current = int(client.get(next_step) or settings.start_step) - settings.first_step
        env = envs[index % len(envs)]
        difficulty = rng.random()
        group = []
        for member in range(settings.group_size):
            fields = {
                "env": env, "policy_version": max(0, current - int(rng.integers(0, 3))),
                "num_input_tokens": int(rng.integers(1, 20)), "num_output_tokens": int(rng.integers(1, 30)),
                "num_turns": int(rng.integers(1, 4)), "is_truncated": bool(rng.random() < 0.1),
                "stop_condition": str(rng.choice(["stop", "length", "tool"])),
            }  # fmt: skip
            if rng.random() < error_rate:
                fields["error"] = str(rng.choice(["timeout", "sandbox"]))
            elif rng.random() < cancel_rate:
                fields["cancelled"] = True
            if env == "math":
                fields["metrics"] = {"solve_time": float(rng.exponential())}
            if env == "code":  # two agents (as a verifiers env's), the other envs verifiers' default
                fields["agent"] = ("solver", "critic")[member % 2]
            reward = float(rng.random() < difficulty) if env != "chat" else round(float(rng.random()), 2)
            group.append(rollout(f"s{seed}-g{index}-r{member}", f"g{index}", reward, **fields))
        try:
            producer.produce(group)
        except AdmissionRefused as refused:  # the run shipped its steps before `stop` was set
            assert refused.reason == "finished", refused
            return
        for record, arrays in group:
            if rng.random() < corrupt_rate:  # damaged after the producer's checks: workers must cope
                damaged = {**arrays, "input_ids": arrays["input_ids"][:-1]}
                client.set(store.keys.rollout(record.rollout_id), pack_arrays(damaged), keepttl=True)
        if rng.random() < 0.05:
            client.xadd(producer.keys.rollout_stream, {"record": b'{"rollout_id": "bad", "reward": 1}'})
        index += 1
        time.sleep(float(rng.choice([0, 0, 0.005, 0.02])))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(SCENARIOS))
def test_records_equal_the_reference(seed, client, redis_url, run_id, workers, tmp_path):
    settings = scenario_settings(seed, run_id, redis_url, workers, tmp_path)
    open_policy_gate(settings)  # the files are read by no trainer, which announces no policy
    stop = threading.Event()
    producer = threading.Thread(target=produce_scenario, args=(seed, settings, stop))
    producer.start()
    try:
        result = asyncio.run(run_orchestrator(settings, timeout=90))
    finally:
        stop.set()
        producer.join()
        PayloadStore(client, run_id).delete_all_rollouts()

    lines = [json.loads(line) for line in settings.record_rollouts.read_text().splitlines()]
    assert check_advantages(lines) == []
    assert len({line["rollout_id"] for line in lines}) == len(lines), "one line per rollout"
    steps = [int(r["step"]) for r in result.records]
    assert steps == list(settings.step_numbers), "one record per step, contiguous"
    expected = reference_records(
        lines, result.records, first_step=settings.first_step, names=settings.record_names
    )
    for record in result.records:
        assert expected[int(record["step"])]["accounting/balanced"] == 1.0, "the reference's own balance"
        assert compare(record, expected[int(record["step"])]) == []
