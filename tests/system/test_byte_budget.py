"""Producers are admitted by bytes as well as by rollouts (`max_held_bytes`), against the real
Redis: what a run holds is counted once per holder and taken back where its bytes go, a call
past the budget waits (nothing written), and a rollout, call or step larger than the budget is
refused at once naming its size and the budget. The oracle of the bytes held is Redis's own
STRLEN of the stored values and the files' sizes on disk."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.admission import Admission, AdmissionRefused
from orchestrator.producer import RolloutProducer
from tests.support.factories import group
from transport.keys import RunKeys
from transport.payload_segments import write_segment_file
from transport.release_scripts import release_rollouts
from transport.store import PayloadStore

LAYERS, TOPK = 48, 8


def admission(batch_size: int, budget: int) -> Admission:
    return Admission(
        limit=1000, batch_size=batch_size, group_size=2, first_step=0, start_step=0,
        max_async_level=100, max_off_policy_steps=100, max_held_bytes=budget,
    )  # fmt: skip


def with_rows(rollouts, directory, tokens_of):
    """The rollouts with routed experts passed by handle from files of their own."""
    out = []
    for record, arrays in rollouts:
        rows = np.full((tokens_of(record), LAYERS, TOPK), 7, np.uint8)
        path = directory / f"{record.rollout_id}.rows"
        out.append((record, {**arrays, "payload": write_segment_file(path, {"routed_experts": rows})}))
    return out


def held(client, keys: RunKeys) -> tuple[int, dict[str, int]]:
    total = int(client.get(keys.held_bytes_total) or 0)
    return total, {k.decode(): int(v) for k, v in client.hgetall(keys.held_bytes).items()}


def test_held_bytes_are_the_stored_bytes_counted_once_and_taken_back(client, run_id, tmp_path):
    keys = RunKeys(run_id)
    producer = RolloutProducer(client, run_id)
    rollouts = with_rows(group("g0", [1.0, 0.0]), tmp_path, lambda r: r.num_tokens)
    producer.produce(rollouts)
    ids = [record.rollout_id for record, _ in rollouts]
    expected = {
        rid: client.strlen(keys.rollout(rid)) + (tmp_path / f"{rid}.rows").stat().st_size for rid in ids
    }
    assert held(client, keys) == (sum(expected.values()), expected)

    store = PayloadStore(client, run_id)
    for _ in range(2):  # a redelivered encode holds its payload's bytes once
        store.put_payload(0, 0, b"\x91\x90" * 50, rows_bytes=1000)
    assert held(client, keys)[1]["payload:0:0"] == 100 + 1000
    for _ in range(2):  # released twice (a redelivered release): taken back once
        release_rollouts(client, keys, ids)
    assert held(client, keys) == (1100, {"payload:0:0": 1100})
    store.release_payloads(ranks=1, through_step=0, evict_through=0)
    assert held(client, keys) == (0, {})


def test_a_call_past_the_budget_waits_and_one_too_large_is_refused_at_once(client, run_id, tmp_path):
    keys = RunKeys(run_id)
    client.set(keys.known_policy_version, 50)  # the policy gate leaves room: bytes decide

    def rollouts(name: str):
        return with_rows(group(name, [1.0, 0.0], num_output_tokens=60), tmp_path, lambda r: r.num_tokens)

    tokens = rollouts("size")[0][0].num_tokens
    per_rollout = tokens * LAYERS * TOPK
    budget = 5 * per_rollout
    producer = RolloutProducer(client, run_id, admission=admission(batch_size=2, budget=budget))
    producer.produce(rollouts("g0"))
    producer.produce(rollouts("g1"))  # 4 rollouts held: a batch is pending, the budget is near
    before = held(client, keys)
    with pytest.raises(AdmissionRefused) as refused:
        producer.produce(rollouts("g2"))
    assert refused.value.reason == "bytes" and refused.value.passes
    assert f"budget of {budget:,} bytes (max_held_bytes)" in str(refused.value)
    assert held(client, keys) == before and not client.exists(keys.rollout("g2-r0"))
    release_rollouts(client, keys, ["g0-r0", "g0-r1"])  # a step released: room again
    producer.produce(rollouts("g2"))
    assert client.exists(keys.rollout("g2-r0"))

    small = RolloutProducer(client, run_id, admission=admission(batch_size=2, budget=per_rollout // 2))
    with pytest.raises(
        AdmissionRefused, match=r"rollout 'g3-r0' holds [\d,]+ bytes .*budget of [\d,]+ bytes"
    ):
        small.produce(rollouts("g3"))
    step_sized = RolloutProducer(client, run_id, admission=admission(batch_size=64, budget=budget))
    with pytest.raises(AdmissionRefused, match=r"a step of 64 rollouts like these holds about [\d,]+ bytes"):
        step_sized.produce(rollouts("g4"))
    assert not client.exists(keys.rollout("g3-r0"), keys.rollout("g4-r0"))


def test_a_batch_short_of_full_is_admitted_past_the_budget(client, run_id, tmp_path):
    """Otherwise a run whose held bytes (retained payloads) fill the budget could never
    complete the batch whose release would free them."""
    keys = RunKeys(run_id)
    client.set(keys.known_policy_version, 50)
    client.set(keys.held_bytes_total, 10**9)  # retained payloads fill the budget
    rollouts = with_rows(group("g0", [1.0, 0.0]), tmp_path, lambda r: r.num_tokens)
    budget = 10**9 + 10
    producer = RolloutProducer(client, run_id, admission=admission(batch_size=4, budget=budget))
    producer.produce(rollouts)  # backlog 0 < batch 4: admitted
    assert client.exists(keys.rollout("g0-r0"))
