"""Per-token credit and groups as prime-rl has them, through real Redis, Celery workers and
the ship path to the trainer ranks' files: rollouts that carry their own advantages, rl
weights and temperatures are decoded (as prime-rl 559b447's trainer decodes them, msgspec)
with exactly those values (rl weights by prime-rl's rule, tests/support/reference.py);
a rollout whose every trainable token has zero advantage is discarded; groups complete at
their env's own size; a group the producer cancels is released at once (its payload and its
bytes gone before any further cut) and the accounting still balances."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from orchestrator.commands.bench.encode import WireMicroBatch
from orchestrator.producer import RolloutProducer, RolloutRejected
from tests.support.factories import rollout
from tests.support.reference import prime_rl_weights
from tests.support.shiprun import ShipResult, delivered, open_policy_gate, ship, ship_settings
from tests.support.stock_peers import read_record, start_stock_ranks
from transport.checksum import payload_checksum
from transport.keys import RunKeys
from transport.store import PayloadStore

pytestmark = pytest.mark.timeout(240)
GROUP_SIZE = {"math": 2, "code": 3}
BATCH = 5  # a math group (2) and a code group (3)


def given_credit(record, arrays, rng: np.random.Generator, zero: bool = False):
    """The rollout with its own advantages (some loss tokens at zero; all of them if `zero`,
    with non-zero advantages outside the loss mask only), rl weights and temperatures."""
    n = record.num_tokens
    mask = arrays["loss_mask"]
    advantages = np.where(rng.random(n) < 0.3, 0.0, rng.normal(size=n)).astype(np.float32)
    if zero:
        advantages = np.where(mask, 0.0, 1.0).astype(np.float32)
    extra = {
        "input_ids": rng.integers(0, 100_000, n),  # unique: finds the sample on the wire
        "advantages": advantages,
        "rl_weights": np.where(rng.random(n) < 0.2, 0.0, rng.random(n) + 0.5),
        "temperatures": rng.uniform(0.5, 1.5, n),
    }
    return record, {**arrays, **extra}


def plain(record, arrays, rng: np.random.Generator):
    return record, {**arrays, "input_ids": rng.integers(0, 100_000, record.num_tokens)}


def math_group(name: str, rng: np.random.Generator, zero: bool = False):
    return [
        given_credit(*rollout(f"{name}-{i}", name, 0.0, env="math", num_output_tokens=7 + i), rng, zero)
        for i in range(GROUP_SIZE["math"])
    ]


def code_group(name: str, rng: np.random.Generator):
    rewards = [1.0, 0.0, 0.0]
    return [
        plain(*rollout(f"{name}-{i}", name, r, env="code", temperature=0.9), rng)
        for i, r in enumerate(rewards)
    ]


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def run_workload(client, settings, shipped: Callable[[int], bool]) -> tuple[list, list[dict[str, float]]]:
    """Write step 1's rollouts, a zero-advantage group and half a group; ship; once step 1
    has `shipped`, cancel the half group, see it released before any further cut, and write
    step 2's rollouts. Returns the rollouts that train and the run's records."""
    producer = RolloutProducer.for_run(client, settings, admitted=False)
    rng = np.random.default_rng(7)
    keys = RunKeys(settings.run_id)

    # The producer holds a group to its env's size.
    with pytest.raises(RolloutRejected, match=r"group_size for env 'code' 3"):
        producer.produce(code_group("short", rng)[:2])

    # Step 1's batch: a math group with its own credit and a code group scored by rlship; a
    # math group whose trainable tokens all have zero advantage; half a math group.
    first = [*math_group("m0", rng), *code_group("c0", rng)]
    flat = math_group("zero", rng, zero=True)
    partial = math_group("gone", rng)[:1]
    for group in (first[:2], first[2:], flat):
        producer.produce(group)
    producer.produce(partial, partial_groups=True)
    gone_id = partial[0][0].rollout_id

    result: dict[str, ShipResult] = {}
    trainers = settings.trainers == "builtin"
    run = threading.Thread(
        target=lambda: result.update(ship=ship(settings, trainers=trainers, produce=False))
    )
    run.start()
    try:
        wait_for(lambda: shipped(0), "step 1 shipped")
        assert client.exists(keys.rollout(gone_id)), "an open group's rollout waits for the rest"
        assert client.hexists(keys.held_bytes, gone_id)
        producer.cancel_group("gone", "math")
        wait_for(lambda: not client.exists(keys.rollout(gone_id)), "the cancelled rollout released")
        assert not client.hexists(keys.held_bytes, gone_id), "its bytes left the budget"
        assert not shipped(1), "released at once, not at a cut"
        producer.produce(math_group("gone", rng)[1:], partial_groups=True)  # too late: rejected
        second = [*math_group("m1", rng), *code_group("c1", rng)]
        for group in (second[:2], second[2:]):
            producer.produce(group)
    finally:
        run.join(200)
    assert not run.is_alive()
    records = result["ship"].records

    outcomes = producer.outcome([gone_id, "gone-1", "zero-0", "zero-1", "m0-0"])
    assert (outcomes[gone_id].state, outcomes[gone_id].reason) == ("discarded", "cancelled")
    assert outcomes["gone-1"].state == "rejected" and outcomes["gone-1"].reason.startswith("group_cancelled")
    assert {outcomes[f"zero-{i}"].reason for i in range(2)} == {"zero_advantage"}
    assert outcomes["m0-0"].state == "shipped"
    last = records[-1]
    assert last["ingest/rejected/group_cancelled"] == 1.0
    assert last["accounting/cancelled_groups"] == 1.0
    assert last["accounting/discarded/cancelled"] == 1.0
    assert last["accounting/discarded/zero_advantage"] == 2.0
    assert all(r["accounting/balanced"] == 1.0 for r in records)
    return [*first, *second], records


def test_given_credit_groups_per_env_and_a_cancelled_group(client, redis_url, run_id, workers, tmp_path):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=2, transport="fs", trainers="external",
        batch_size=BATCH, group_size=GROUP_SIZE, envs=["math", "code"], max_off_policy_steps=100,
        record_names="rlship-1",  # rlship-1: its progress/rollouts counts the shipped rollouts
    )  # fmt: skip
    open_policy_gate(settings)
    steps = [Path(tmp_path, "rollouts", f"step_{n}") for n in settings.step_numbers]
    trained, records = run_workload(client, settings, lambda k: (steps[k] / "rank_1.bin").exists())

    # What the ranks decode, sample by sample.
    sent = {tuple(arrays["input_ids"].tolist()): (record, arrays) for record, arrays in trained}
    seen = {"given": 0, "group_baseline": 0}
    for path in sorted(Path(tmp_path, "rollouts").glob("step_*/rank_*.bin")):
        for mb in msgspec.msgpack.Decoder(list[WireMicroBatch]).decode(path.read_bytes()):
            start = 0
            for length in mb.sequence_lengths:
                at = slice(start, start + length)
                start += length
                found = sent.get(tuple(mb.input_ids[at]))
                if found is None:
                    assert set(mb.env_names[at]) == {"padding"}
                    continue
                record, arrays = found
                mask = arrays["loss_mask"].tolist()
                if "advantages" in arrays:
                    seen["given"] += 1
                    advantages = arrays["advantages"].astype(float).tolist()
                    assert mb.advantages[at] == advantages
                    assert mb.temperatures[at] == arrays["temperatures"].tolist()
                    assert mb.rl_weights[at] == prime_rl_weights(
                        mask, advantages, arrays["rl_weights"].tolist()
                    )
                else:
                    seen["group_baseline"] += 1
                    expected = record.reward - 1.0 / 3.0  # rewards 1, 0, 0
                    assert mb.advantages[at] == pytest.approx([expected] * length, abs=1e-12)
                    assert mb.temperatures[at] == [0.9] * length
                    assert mb.rl_weights[at] == prime_rl_weights(mask, [expected] * length, None)
    assert sum(seen.values()) == 2 * BATCH, "every shipped rollout found on the wire once"
    assert seen == {
        "given": sum(r["credit/given"] for r in records),
        "group_baseline": sum(r["credit/group_baseline"] for r in records),
    }
    assert all(r["credit/given"] + r["credit/group_baseline"] == r["progress/rollouts"] for r in records)


def test_rlships_and_prime_rls_stock_ranks_receive_the_same_steps_over_zmq(
    client, redis_url, run_id, workers, tmp_path
):
    """The same workload over ZMQ to rlship's trainer ranks (each decodes, checks and records
    every step: transport.trainer) and to prime-rl's stock receivers (tests/support/stock_peers:
    msgspec decodes as a 559b447 rank): the bytes each rank got are the files' of the first run."""
    common = dict(
        steps=2, batch_size=BATCH, group_size=GROUP_SIZE, envs=["math", "code"], max_off_policy_steps=100
    )
    files = ship_settings(
        run_id, redis_url, workers, tmp_path / "fs", transport="fs", trainers="external", **common
    )
    open_policy_gate(files)
    folders = [Path(tmp_path, "fs", "rollouts", f"step_{n}") for n in files.step_numbers]
    run_workload(client, files, lambda k: (folders[k] / "rank_1.bin").exists())
    expected = [
        [(folder / f"rank_{rank}.bin").read_bytes() for rank in range(files.ranks)] for folder in folders
    ]

    ours = ship_settings(
        f"{run_id}-ours", redis_url, workers, tmp_path / "ours", trainers="builtin", **common
    )
    stock = ship_settings(
        f"{run_id}-stock", redis_url, workers, tmp_path / "stock", trainers="external", **common
    )
    peers: list = []
    try:
        received = lambda: delivered(client, ours.run_id, ours.ranks)[0]  # noqa: E731
        run_workload(
            client, ours, lambda k: all(ours.step_numbers[k] in received()[r] for r in range(ours.ranks))
        )
        got = received()
        assert [[got[r][step] for r in range(ours.ranks)] for step in ours.step_numbers] == [
            [payload_checksum(payload) for payload in step] for step in expected
        ]

        Path(stock.output_dir).mkdir(parents=True)
        records, peers = start_stock_ranks(stock, [None] * stock.ranks)

        def stock_has(k: int) -> bool:
            step = stock.step_numbers[k]
            return all(any(line["topic_step"] == step for line in read_record(r)) for r in records)

        run_workload(client, stock, stock_has)
        by_rank = [{line["topic_step"]: line["sha256"] for line in read_record(r)} for r in records]
        assert [[by_rank[r][step] for r in range(stock.ranks)] for step in stock.step_numbers] == [
            [hashlib.sha256(payload).hexdigest() for payload in step] for step in expected
        ]
    finally:
        for peer in peers:
            peer.kill()
            peer.wait()
        for settings in (ours, stock):
            PayloadStore(client, settings.run_id).expire_run(3600)
