"""What a trainer receives, checked against what went in, by oracles that share no code
with the ship path: the payload bytes a trainer got are decoded with plain
`msgpack.unpackb` and hashed with xxHash's streaming state; the expected fields, advantages, batches and
accounting are computed here from the rollouts this test wrote itself."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass

import msgpack
import numpy as np
import pytest

from orchestrator.producer import RolloutProducer
from orchestrator.records import RolloutRecord
from tests.support.checksums import streamed_xxh3_128
from tests.support.shiprun import open_policy_gate, run_orchestrator, ship, ship_settings
from tests.support.wire_trainer import WireTrainer
from transport.filesystem import payload_path
from transport.keys import RunKeys
from transport.store import PayloadStore

pytestmark = pytest.mark.timeout(240)

STEPS, RANKS, BATCH, GROUP, SEQ_LEN, PAD = 3, 2, 8, 4, 64, 8
# (env, temperature, rewards, index of an errored member or None): zero-advantage groups,
# a member with exactly zero advantage, an errored member left out of the baseline.
GROUPS = [
    ("math", 1.0, [1.0, 0.0, 0.0, 0.0], None),
    ("code", 0.7, [0.5, 0.5, 0.5, 0.5], None),
    ("math", 1.0, [0.9, 0.2, 0.4, 0.7], None),
    ("code", 1.3, [1.0, 0.0, 1.0, 0.0], 3),
    ("math", 0.9, [0.25, 1.0, 0.0, 0.5], None),
    ("code", 1.0, [0.0, 0.0, 0.0, 0.0], None),
    ("math", 1.1, [0.3, 0.6, 0.1, 0.8], None),
    ("code", 0.5, [1.0, 0.0, 0.0, 1.0], None),
    ("math", 1.0, [0.2, 0.4, 0.6, 0.8], None),
    ("code", 1.2, [0.1, 0.9, 0.5, 0.3], None),
    ("math", 1.0, [1.0, 0.0, 0.5, 0.5], None),
]
OPEN_GROUP_MEMBERS = 2  # a group that never completes: in open groups at every cut
MALFORMED = [b'{"rollout_id": "bad", "reward": 1}', b"not json"]


@dataclass
class Sent:
    """One rollout as this test wrote it, and the advantage it must train with."""

    record: RolloutRecord
    arrays: dict[str, np.ndarray]
    advantage: float
    trainable: bool


def expected_advantages(rewards: list[float], errored: int | None) -> list[float]:
    """Reward minus the mean of the group's scored members; zero when they all agree;
    an errored member scores nothing and gets zero."""
    scored = [r for i, r in enumerate(rewards) if i != errored]
    mean = sum(scored) / len(scored)
    if all(r == scored[0] for r in scored):
        return [0.0] * len(rewards)
    return [0.0 if i == errored else r - mean for i, r in enumerate(rewards)]


def make_rollout(index: int, group_id: str, env: str, temperature: float, reward: float, **fields):
    rng = np.random.default_rng(index)
    num_input, num_output = 2 + index % 5, 3 + (7 * index) % 17
    total = num_input + num_output
    record = RolloutRecord(
        rollout_id=f"o{index}", group_id=group_id, task_id=f"t-{group_id}", env=env, policy_version=0,
        reward=reward, num_input_tokens=num_input, num_output_tokens=num_output, temperature=temperature,
        **fields,
    )  # fmt: skip
    arrays = {
        # The first token names the rollout, so a trainer's segment can be traced back to it.
        "input_ids": np.concatenate([[1000 + index], rng.integers(0, 1000, total - 1)]).astype(np.int32),
        "loss_mask": np.arange(total) >= num_input,
        "inference_logprobs": -rng.random(total).astype(np.float32),
        "routed_experts": rng.integers(0, 8, size=(total, 2, 3), dtype=np.uint8),
    }
    return record, arrays


def write_workload(client, run_id: str) -> list[Sent]:
    """Everything the run will read, written before it starts (fewer records than one
    read batch, so every cut sees all of them): return the rollouts in completion order."""
    producer = RolloutProducer(client, run_id)
    keys = RunKeys(run_id)
    for raw in MALFORMED:
        client.xadd(keys.rollout_stream, {"record": raw})
    sent: list[Sent] = []
    index = 0
    for g, (env, temperature, rewards, errored) in enumerate(GROUPS):
        members = []
        advantages = expected_advantages(rewards, errored)
        for m, (reward, advantage) in enumerate(zip(rewards, advantages, strict=True)):
            fields = {"error": "timeout"} if m == errored else {}
            record, arrays = make_rollout(index, f"g{g}", env, temperature, reward, **fields)
            members.append((record, arrays))
            sent.append(Sent(record, arrays, advantage, advantage != 0.0 and m != errored))
            index += 1
        producer.produce(members)
    producer.produce([make_rollout(index + m, "open", "math", 1.0, 1.0) for m in range(OPEN_GROUP_MEMBERS)])
    return sent


def check_microbatch(fields: list, by_first_token: dict[int, Sent]) -> list[Sent]:
    """Every field of one decoded micro-batch against the rollouts it carries; return them."""
    assert len(fields) == 16, f"a MicroBatch has 16 positional fields, got {len(fields)}"
    (input_ids, loss_mask, advantages, logprobs, positions, sequence_lengths, temperatures,
     env_names, seq_lens, ref_logprobs, routed, mm_kwargs, mm_token_types, rl_weights,
     ce_weights, ref_kl) = fields  # fmt: skip
    n = len(input_ids)
    assert all(type(t) is int for t in input_ids) and all(type(m) is bool for m in loss_mask)
    per_token = {
        "loss_mask": loss_mask, "advantages": advantages, "inference_logprobs": logprobs,
        "position_ids": positions, "temperatures": temperatures, "env_names": env_names,
        "rl_weights": rl_weights,
    }  # fmt: skip
    for name, column in per_token.items():
        assert len(column) == n, f"{name}: {len(column)} entries for {n} tokens"
    assert sequence_lengths == seq_lens and sum(sequence_lengths) == n
    assert n <= SEQ_LEN and n % PAD == 0, f"micro-batch of {n} tokens (seq_len {SEQ_LEN}, multiple of {PAD})"
    assert ref_logprobs is None and mm_kwargs is None and mm_token_types is None
    assert ce_weights is None and ref_kl is None
    data, shape, dtype = routed
    experts = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    assert experts.shape[0] == n

    carried = []
    start = 0
    for number, length in enumerate(sequence_lengths):
        end = start + length
        sample = by_first_token.get(input_ids[start])
        if sample is None:  # padding: the micro-batch's last segment, and it cannot train
            assert number == len(sequence_lengths) - 1, f"segment {number} of {len(sequence_lengths)} unknown"
            assert not any(loss_mask[start:end]) and not any(rl_weights[start:end])
            assert not any(advantages[start:end])
        else:
            arrays = sample.arrays
            carried.append(sample)
            assert input_ids[start:end] == arrays["input_ids"].tolist()
            assert loss_mask[start:end] == arrays["loss_mask"].tolist()
            assert logprobs[start:end] == [float(x) for x in arrays["inference_logprobs"]]
            assert all(
                math.isclose(a, sample.advantage, rel_tol=1e-12, abs_tol=1e-15) for a in advantages[start:end]
            ), f"{sample.record.rollout_id}: advantages {advantages[start]} != {sample.advantage}"
            assert temperatures[start:end] == [sample.record.temperature] * length
            assert env_names[start:end] == [sample.record.env] * length
            assert rl_weights[start:end] == [1.0 if m else 0.0 for m in arrays["loss_mask"]]
            np.testing.assert_array_equal(experts[start:end], arrays["routed_experts"])
        assert positions[start:end] == list(range(length))
        start = end
    return carried


def check_delivery(received: dict[tuple[int, int], bytes], sent: list[Sent]) -> None:
    """Each step's payloads carry exactly the step's batch, each rollout once, field by field."""
    trainable = [s for s in sent if s.trainable]
    by_first_token = {int(s.arrays["input_ids"][0]): s for s in sent}
    assert sorted(received) == [(step, rank) for step in range(STEPS) for rank in range(RANKS)]
    for step in range(STEPS):
        carried = []
        for rank in range(RANKS):
            for fields in msgpack.unpackb(received[(step, rank)], raw=False):
                carried += check_microbatch(fields, by_first_token)
        ids = [s.record.rollout_id for s in carried]
        assert len(ids) == len(set(ids)), f"step {step}: a rollout sent twice"
        # Trainable rollouts are cut in the order their groups completed.
        batch = trainable[step * BATCH : (step + 1) * BATCH]
        assert sorted(ids) == sorted(s.record.rollout_id for s in batch)


def check_accounting(client, run_id: str, sent: list[Sent]) -> None:
    """Each record's counts, from this test's own tally of what it wrote."""
    trainable = sum(s.trainable for s in sent)
    arrived = len(MALFORMED) + len(sent) + OPEN_GROUP_MEMBERS
    discarded = len(sent) - trainable
    entries = client.xrange(RunKeys(run_id).metrics_stream)
    records = [json.loads(fields[b"record"]) for _, fields in entries]
    assert [r["step"] for r in records] == list(range(STEPS))
    for step, record in enumerate(records):
        shipped = BATCH * (step + 1)
        expected = {
            "accounting/arrived": arrived,
            "accounting/rejected": len(MALFORMED),
            "accounting/in_open_groups": OPEN_GROUP_MEMBERS,
            "accounting/discarded": discarded,
            "accounting/shipped": shipped,
            "accounting/dropped_by_workers": 0,
            "accounting/pending": trainable - shipped,
            "accounting/balanced": 1.0,
        }
        assert {k: record[k] for k in expected} == expected, f"step {step}"
        if step > 0:  # every group completed before the first cut: the later windows are empty
            assert record["train/agg/all/count"] == 0
            empty = {k: v for k, v in record.items() if k.startswith("train/agg/all/") and k.endswith("/p90")}
            assert empty.keys() == {
                k for k in records[0] if k.startswith("train/agg/all/") and k.endswith("/p90")
            }
            assert all(math.isnan(v) for v in empty.values()), empty


@pytest.mark.parametrize("transport", ["zmq", "fs"])
def test_what_a_trainer_decodes_is_what_the_rollouts_said(
    transport, client, redis_url, run_id, workers, tmp_path
):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, transport=transport, steps=STEPS, ranks=RANKS,
        batch_size=BATCH, group_size=GROUP, seq_len=SEQ_LEN, pad_to_multiple=PAD,
        max_off_policy_steps=100, envs=["math", "code"], samples_per_step=0,
        record_names="rlship-1",  # the rlship-1 statistics: `count`, NaN for an empty window
        trainers="external" if transport == "zmq" else "builtin",
        first_step=0,  # the steps below are numbered from 0
    )  # fmt: skip
    sent = write_workload(client, run_id)
    keys = RunKeys(run_id)
    if transport == "zmq":
        open_policy_gate(settings)  # the plain-socket trainer announces no policy
        # An independent trainer: plain sockets, every message kept as it arrived.
        with WireTrainer("127.0.0.1", settings.zmq_port, RANKS) as trainer:
            asyncio.run(run_orchestrator(settings))
            trainer.wait_for({(rank, step) for rank in range(RANKS) for step in range(STEPS)})
        assert set(trainer.counts().values()) == {1}, f"one message per rank and step: {trainer.counts()}"
        assert trainer.run_ids == {settings.run_id}, "every topic names the run"
        received = {(step, rank): payload for rank, step, payload in trainer.received()}
    else:
        ship(settings, produce=False)
        received = {
            (step, rank): payload_path(tmp_path, step, rank).read_bytes()
            for step in range(STEPS)
            for rank in range(RANKS)
        }
        # The trainer ranks' own checksums, against the bytes they read.
        for rank in range(RANKS):
            acknowledged = {int(s): c.decode() for s, c in client.hgetall(keys.received(rank)).items()}
            assert acknowledged == {step: streamed_xxh3_128(received[(step, rank)]) for step in range(STEPS)}
    PayloadStore(client, run_id).delete_all_rollouts()

    # The checksum every summary and test relies on is XXH3-128 of the bytes the trainer got.
    reported = {k.decode(): v.decode() for k, v in client.hgetall(RunKeys(run_id).sent_checksums).items()}
    assert reported == {
        f"{step}:{rank}": streamed_xxh3_128(payload) for (step, rank), payload in received.items()
    }
    check_delivery(received, sent)
    check_accounting(client, run_id, sent)
