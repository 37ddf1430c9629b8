"""The ship-path tasks run in this process, one after another, against the real Redis and the
filesystem transport: what each task stores, marks and enqueues, and what the trainer files
hold, checked with plain msgpack, xxhash and hand-computed values. No Celery worker runs:
successor messages land on this test's own queues, where the test reads them."""

from __future__ import annotations

import ast
import dataclasses
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
import xxhash

from orchestrator.commands.processes import delete_queues
from tasks import faults, ship
from tasks import send as send_module
from tasks.cohort import NUMERIC_COLUMNS, Cohort, CohortBuilder
from tasks.manifest import ShipConfig, StepManifest
from tests.support.factories import store_rollout_arrays
from transport.keys import RunKeys
from transport.store import PayloadMissingError, PayloadStore

# rollout id: (input_ids, number of prompt tokens, advantage, env); "flat" has zero advantage.
ROLLOUTS = {
    "a": ([11, 12, 13, 14], 1, 0.5, "math"),
    "b": ([21, 22, 23], 2, -0.5, "math"),
    "c": ([31, 32, 33, 34, 35], 2, 1.0, "code"),
    "flat": ([41, 42], 1, 0.0, "code"),
}
RANKS = 2


@pytest.fixture()
def shipped_step(
    client: redis.Redis, run_id: str, tmp_path: Path
) -> Iterator[tuple[PayloadStore, ShipConfig]]:
    store = PayloadStore(client, run_id)
    config = ShipConfig(ranks=RANKS, seq_len=64, transport="fs", output_dir=str(tmp_path), vocab_size=100,
                        cpu_queue=f"cpu-{run_id}", ship_queue=f"ship-{run_id}",
                        record_names="rlship-1")  # rlship-1: progress/rollouts, shipped  # fmt: skip
    builder = CohortBuilder()
    for rollout_id, (ids, prompt, advantage, env) in ROLLOUTS.items():
        store_rollout_arrays(client, run_id, {rollout_id: {
            "input_ids": np.array(ids, dtype=np.int32),
            "loss_mask": np.arange(len(ids)) >= prompt,
            "inference_logprobs": -np.arange(len(ids), dtype=np.float32) / 4,
        }})  # fmt: skip
        numeric = dict.fromkeys(NUMERIC_COLUMNS, 0.0) | {
            "advantage": advantage, "reward": advantage, "num_input_tokens": prompt,
            "num_output_tokens": len(ids) - prompt, "temperature": 1.0, "is_trainable": 1.0,
        }  # fmt: skip
        builder.append(numeric, {"rollout_id": rollout_id, "env": env, "group_id": env, "task_id": env})
    cohort = builder.build()
    counters = {"accounting/arrived": 4.0, "accounting/pending": 0.0, "accounting/in_open_groups": 0.0,
                "accounting/rejected": 0.0, "accounting/discarded": 0.0}  # fmt: skip
    manifest = StepManifest(run_id, 0, -1, 0.0, config, cohort, cohort, counters=counters)
    store.put_step_value(0, "manifest", manifest.to_bytes())
    client.set(RunKeys(run_id).alive, 1, ex=60)  # a live run: its tasks are not dropped
    try:
        yield store, config
    finally:
        client.delete(*client.scan_iter(f"rlship:{run_id}:*"))
        delete_queues(client, [config.cpu_queue, config.ship_queue])


@pytest.fixture()
def values_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the step values read whole from Redis (`PayloadStore.get_step_value`), in order."""
    read: list[str] = []
    real_read = PayloadStore.get_step_value

    def reading(self: PayloadStore, step: int, name: str) -> bytes:
        read.append(name)
        return real_read(self, step, name)

    monkeypatch.setattr(PayloadStore, "get_step_value", reading)
    return read


def _enqueued(client: redis.Redis, queue: str) -> list[tuple[str, list]]:
    """(task name, arguments) of every message on the queue, oldest first; the queue is emptied."""
    messages = [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]
    client.delete(queue)
    return [(m["headers"]["task"], list(ast.literal_eval(m["headers"]["argsrepr"]))) for m in messages]


def test_one_step_through_every_task(
    client: redis.Redis, run_id: str, shipped_step, values_read: list[str]
) -> None:
    store, config = shipped_step
    cpu, ship_queue = config.cpu_queue, config.ship_queue
    ship.finalize(run_id, 0)  # and prune and pack, in its task
    assert values_read == ["manifest"], "prune and pack took finalize's and prune's outputs from memory"
    encodes = [("rlship.encode", [run_id, 0, r]) for r in range(RANKS)]
    assert _enqueued(client, cpu) == [("rlship.metrics", [run_id, 0]), *encodes]
    ship.metrics(run_id, 0)
    assert _enqueued(client, cpu) == [], "publish waits for every rank's send"
    for rank in range(RANKS):
        ship.encode(run_id, 0, rank)
    assert _enqueued(client, ship_queue) == [("rlship.send", [run_id, 0, r]) for r in range(RANKS)]
    ship.send(run_id, 0, 0)
    assert _enqueued(client, cpu) == [], "one rank of two sent"
    ship.send(run_id, 0, 1)
    assert _enqueued(client, cpu) == [("rlship.publish", [run_id, 0])]
    ship.publish(run_id, 0)

    # What the trainer ranks got: every trainable rollout once, with its own advantage.
    seen = {}
    checksums = client.hgetall(RunKeys(run_id).sent_checksums)
    for rank in range(RANKS):
        data = (Path(config.output_dir) / "rollouts" / "step_0" / f"rank_{rank}.bin").read_bytes()
        assert checksums[f"0:{rank}".encode()].decode() == xxhash.xxh3_128(data).hexdigest()
        for batch in msgpack.unpackb(data, raw=False):
            start = 0
            for length in batch[5]:
                end = start + length
                if batch[7][start] != "padding":
                    seen[tuple(batch[0][start:end])] = (set(batch[2][start:end]), set(batch[7][start:end]))
                start = end
    expected = {tuple(ids): ({adv}, {env}) for ids, _, adv, env in ROLLOUTS.values() if adv}
    assert seen == expected

    # The one record.
    [(_, fields)] = client.xrange(store.keys.metrics_stream)
    record = json.loads(fields[b"record"])
    assert record["step"] == 0.0 and record["progress/rollouts"] == 3.0
    assert record["progress/dropped_by_workers/no_trainable_tokens"] == 1.0
    assert record["progress/total_rollouts"] == 3.0 and record["progress/total_steps"] == 1.0
    assert record["accounting/shipped"] == 3.0 and record["accounting/dropped_by_workers"] == 1.0
    assert record["accounting/balanced"] == 1.0
    assert record["progress/tokens"] == 12.0, "4 + 3 + 5 tokens shipped"
    stages = {"finalize", "prune", "metrics", "pack", "encode", "send"}
    assert {k.split("/", 1)[1] for k in record if k.startswith("time/")} == stages | {
        "ship",
        "wait_for_policy",
        "wait_for_ckpt",  # prime-rl's name of wait_for_policy
    }
    times = {k.decode() for k in client.hgetall(store.keys.step(0, "times"))}
    assert times == {"finalize", "prune", "metrics", "pack", "encode:0", "encode:1", "send:0", "send:1"}
    for name in ("finalize", "prune", "metrics", "pack", "encode:0", "encode:1"):
        assert client.ttl(store.keys.step(0, f"done:{name}")) > 0
    raw_calls = client.hgetall(RunKeys(run_id).stage_calls)
    calls = {k.decode().rsplit(":", 1)[1]: int(v) for k, v in raw_calls.items()}
    assert calls == {"finalize": 1, "prune": 1, "metrics": 1, "pack": 1, "encode": 2}
    assert client.hexists(RunKeys(run_id).published, 0)

    # Every task again, after the step is published: nothing computed, enqueued or recorded twice.
    for task, args in [(ship.finalize, ()), (ship.metrics, ()), (ship.encode, (0,)), (ship.send, (1,)),
                       (ship.publish, ())]:  # fmt: skip
        task(run_id, 0, *args)
    assert _enqueued(client, cpu) == [] and _enqueued(client, ship_queue) == []
    assert client.xlen(store.keys.metrics_stream) == 1
    assert client.hgetall(RunKeys(run_id).stage_calls) == raw_calls, "no stage computed again"

    marked = store.keys.marked_ranks(0, "encode")
    assert client.lrange(marked, 0, -1) == [b"0", b"1"] and client.ttl(marked) > 0
    ship.release(run_id, 0, RANKS, 8)
    assert client.hexists(RunKeys(run_id).released, 0)
    assert not client.exists(store.keys.step(0, "manifest"), store.keys.step(0, "times"), marked)


def test_a_stage_already_done_is_not_computed_again(client: redis.Redis, run_id: str, shipped_step) -> None:
    _, config = shipped_step
    ship.finalize(run_id, 0)
    ship.finalize(run_id, 0)
    successors = [("rlship.metrics", [run_id, 0]), *(("rlship.encode", [run_id, 0, r]) for r in range(RANKS))]
    assert _enqueued(client, config.cpu_queue) == successors * 2, "successors again"
    calls = client.hgetall(RunKeys(run_id).stage_calls)
    assert [int(v) for v in calls.values()] == [1, 1, 1], "finalize, prune and pack computed once"
    ctx = ship.StepContext(run_id, 0)
    assert not ctx.is_published() and not ctx.is_published(0)
    client.hset(ctx.keys.published, 0, 1.0)
    assert ctx.is_published() and not ctx.is_published(1)
    ctx.put("x", {"k": [1, 2]})
    assert ctx.get("x") == {"k": [1, 2]}


def rank_file(config: ShipConfig, rank: int) -> Path:
    return Path(config.output_dir) / "rollouts" / "step_0" / f"rank_{rank}.bin"


def encode_every_rank(run_id: str) -> None:
    """Step 0 finalized and every rank's payload encoded: what a send task finds."""
    ship.finalize(run_id, 0)
    for rank in range(RANKS):
        ship.encode(run_id, 0, rank)


def test_a_send_also_sends_every_rank_whose_payload_is_ready(
    client: redis.Redis, run_id: str, shipped_step
) -> None:
    """Rank 0's send task finds rank 1's payload encoded and sends it too, marked as its own
    would be; rank 1's own task then sends nothing and records the rank in the step's `sent`
    set, which alone lets publish follow. The oracle: the files, the marks, the queue."""
    _, config = shipped_step
    keys = RunKeys(run_id)
    encode_every_rank(run_id)
    ship.metrics(run_id, 0)
    _enqueued(client, config.cpu_queue)
    _enqueued(client, config.ship_queue)
    ship.send(run_id, 0, 0)
    assert rank_file(config, 1).exists(), "rank 1's step sent by rank 0's task"
    assert [client.get(keys.last_sent(r)) for r in range(RANKS)] == [b"0", b"0"]
    assert client.hexists(keys.times(0), "send:1")
    assert client.smembers(keys.sent(0)) == {b"0"} and _enqueued(client, config.cpu_queue) == []
    rank_file(config, 1).unlink()
    ship.send(run_id, 0, 1)
    assert not rank_file(config, 1).exists(), "rank 1's own task did not send it again"
    assert _enqueued(client, config.cpu_queue) == [("rlship.publish", [run_id, 0])]
    assert client.hlen(keys.interrupted_sends) == 0


def test_a_send_stays_for_a_rank_still_encoding_and_sends_it_when_its_encode_ends(
    client: redis.Redis, run_id: str, shipped_step, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's send task, its own rank sent, waits while rank 1 encodes and sends rank 1
    the moment its encode is marked (long before the wait's limit); rank 1's own task
    then finds it sent. The oracle: the task still running, then the file and the marks."""
    _, config = shipped_step
    keys = RunKeys(run_id)
    monkeypatch.setattr(send_module, "ENCODE_WAIT_SECONDS", 60.0)
    ship.finalize(run_id, 0)
    ship.encode(run_id, 0, 0)
    sending = threading.Thread(target=ship.send, args=(run_id, 0, 0))
    sending.start()
    sending.join(timeout=1.0)
    assert sending.is_alive(), "the send waits for rank 1's encode"
    assert rank_file(config, 0).exists() and not rank_file(config, 1).exists()
    assert client.get(keys.last_sent(0)) == b"0", "its own rank marked sent before the wait"
    ship.encode(run_id, 0, 1)
    sending.join(timeout=20.0)
    assert not sending.is_alive(), "woken by rank 1's mark, not by the wait's limit"
    assert rank_file(config, 1).exists() and client.get(keys.last_sent(1)) == b"0"
    assert client.hexists(keys.times(0), "send:1")
    rank_file(config, 1).unlink()
    ship.send(run_id, 0, 1)
    assert not rank_file(config, 1).exists(), "rank 1's own task did not send it again"
    assert client.smembers(keys.sent(0)) == {b"0", b"1"}
    assert client.hlen(keys.interrupted_sends) == 0


def test_a_send_leaves_a_rank_not_encoded_to_its_own_task(
    client: redis.Redis, run_id: str, shipped_step, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No encode ends within the wait's limit: the send returns and the rank's own task
    sends it once it is encoded."""
    _, config = shipped_step
    monkeypatch.setattr(send_module, "ENCODE_WAIT_SECONDS", 0.2)
    keys = RunKeys(run_id)
    ship.finalize(run_id, 0)
    ship.encode(run_id, 0, 0)
    ship.send(run_id, 0, 0)
    assert not rank_file(config, 1).exists() and client.get(keys.last_sent(1)) is None
    ship.encode(run_id, 0, 1)
    ship.send(run_id, 0, 1)
    assert rank_file(config, 1).exists() and client.get(keys.last_sent(1)) == b"0"


def test_a_send_leaves_a_rank_that_acknowledged_its_step_to_its_own_task(
    client: redis.Redis, run_id: str, shipped_step
) -> None:
    """A rank that acknowledged the step (sent by a process that died before marking it) is
    not sent it again by another rank's task; its own task marks it sent without sending."""
    _, config = shipped_step
    keys = RunKeys(run_id)
    encode_every_rank(run_id)
    client.hset(keys.received(1), 0, 1)
    ship.send(run_id, 0, 0)
    assert not rank_file(config, 1).exists() and client.get(keys.last_sent(1)) is None
    ship.send(run_id, 0, 1)
    assert not rank_file(config, 1).exists() and client.get(keys.last_sent(1)) == b"0"


def test_a_companion_whose_payload_is_gone_is_left_to_its_own_task(
    client: redis.Redis, run_id: str, shipped_step
) -> None:
    """Rank 1's payload missing from Redis does not fail rank 0's send; rank 1's own task
    meets it and fails as it would alone."""
    _, config = shipped_step
    keys = RunKeys(run_id)
    encode_every_rank(run_id)
    client.delete(keys.payload(0, 1))
    ship.send(run_id, 0, 0)
    assert rank_file(config, 0).exists() and not rank_file(config, 1).exists()
    assert client.get(keys.last_sent(1)) is None
    with pytest.raises(PayloadMissingError):
        ship.send(run_id, 0, 1)


class Killed(Exception):
    pass


def test_a_finalize_redelivered_after_a_kill_in_a_carried_stage_runs_it_from_what_redis_holds(
    client: redis.Redis, run_id: str, shipped_step, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prune runs in finalize's task: a worker killed after prune computed and before its mark
    leaves finalize marked and prune not; the delivery again (acks late) finds finalize done
    and runs prune and pack from the finalized samples Redis holds, then enqueues what
    follows. The oracle: the marks, the per-process call counts and the queue."""
    _, config = shipped_step
    monkeypatch.setattr(faults, "enabled", lambda: True)

    def kill(pid: int, sig: int) -> None:
        raise Killed(pid, sig)

    monkeypatch.setattr(faults.os, "kill", kill)
    client.hset(RunKeys(run_id).faults, "prune:0", 1)
    with pytest.raises(Killed):
        ship.finalize(run_id, 0)
    keys = RunKeys(run_id)
    assert client.exists(keys.done(0, "finalize")) and not client.exists(keys.done(0, "prune"))
    assert _enqueued(client, config.cpu_queue) == [], "nothing follows a killed task"
    ship.finalize(run_id, 0)  # the redelivery
    assert client.exists(keys.done(0, "prune"), keys.done(0, "pack")) == 2
    successors = [("rlship.metrics", [run_id, 0]), *(("rlship.encode", [run_id, 0, r]) for r in range(RANKS))]
    assert _enqueued(client, config.cpu_queue) == successors
    calls = {k.decode().rsplit(":", 1)[1]: int(v) for k, v in client.hgetall(keys.stage_calls).items()}
    assert calls == {"finalize": 1, "prune": 1, "pack": 1}, "the killed prune left no count"
    samples = msgpack.unpackb(client.get(keys.step(0, "pruned")), raw=False)["samples"]
    assert sorted(samples["labels"]["rollout_id"]) == ["a", "b", "c"], "pruned from the stored samples"


def test_a_process_reads_a_steps_manifest_whole_once_per_cut(
    client: redis.Redis, run_id: str, shipped_step, values_read: list[str]
) -> None:
    """Every task of a step needs its manifest: a process reads it whole once, then only its
    opening bytes; a step cut again under the same number (found empty) is read whole again.
    The oracle: the manifests' own cut ids and which step values were read whole."""
    store, _ = shipped_step
    first = ship.StepContext(run_id, 0).manifest
    assert ship.StepContext(run_id, 0).manifest is first and values_read == ["manifest"], "read whole once"
    again = StepManifest.from_bytes(store.get_step_value(0, "manifest"))
    recut = dataclasses.replace(again, cut_id=uuid.uuid4().hex, cut_time=again.cut_time + 1)
    assert recut.to_bytes()[: len(first.cut_id) + 16] != first.to_bytes()[: len(first.cut_id) + 16]
    values_read.clear()
    store.put_step_value(0, "manifest", recut.to_bytes())
    got = ship.StepContext(run_id, 0).manifest
    assert (got.cut_id, got.cut_time, values_read) == (recut.cut_id, recut.cut_time, ["manifest"]), (
        "the new cut's"
    )
    store.client.delete(store.keys.step(0, "manifest"))
    with pytest.raises(PayloadMissingError):
        ship.StepContext(run_id, 0).manifest  # noqa: B018  (released: not served from memory)


@pytest.fixture()
def kills_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Faults armed; a fault's kill raises `Killed` in this process instead."""
    monkeypatch.setattr(faults, "enabled", lambda: True)

    def kill(pid: int, sig: int) -> None:
        raise Killed(pid, sig)

    monkeypatch.setattr(faults.os, "kill", kill)


def test_a_send_killed_after_one_rank_left_marks_the_others_first(
    client: redis.Redis, run_id: str, shipped_step, kills_raise
) -> None:
    """The `send` fault at rank 0 in a task sending ranks 0 and 1: rank 1's payload leaves and
    is marked before the kill, so only rank 0's step is left in the window (sent again)."""
    keys = RunKeys(run_id)
    encode_every_rank(run_id)
    client.hset(keys.faults, faults.fault_field("send", 0, 0), faults.KILL)
    with pytest.raises(Killed):
        ship.send(run_id, 0, 0)
    assert client.get(keys.last_sent(0)) is None, "the armed rank: left, not marked"
    assert client.get(keys.last_sent(1)) == b"0", "the other rank: marked before the kill"


def test_a_send_killed_at_a_ranks_sending_mark_has_handed_nothing_over(
    client: redis.Redis, run_id: str, shipped_step, kills_raise
) -> None:
    """The `sending` fault at rank 1 in rank 0's task: every mark of the batch is written
    before any payload is handed over, so the kill has sent nothing; each rank's task sends
    its step again, once, and counts the resend."""
    _, config = shipped_step
    keys = RunKeys(run_id)
    encode_every_rank(run_id)
    client.hset(keys.faults, faults.fault_field("sending", 0, 1), faults.KILL)
    with pytest.raises(Killed):
        ship.send(run_id, 0, 0)
    assert not rank_file(config, 0).exists() and not rank_file(config, 1).exists()
    assert [client.get(keys.sending(r)) for r in range(RANKS)] == [b"0", b"0"]
    send_module._intents.clear()  # the killed process's memory
    ship.send(run_id, 0, 0)
    assert rank_file(config, 0).exists() and rank_file(config, 1).exists()
    assert client.hgetall(keys.interrupted_sends) == {b"0:0": b"1", b"0:1": b"1"}


def test_a_process_decodes_a_steps_samples_and_plan_once_per_cut(
    client: redis.Redis, run_id: str, shipped_step, values_read: list[str]
) -> None:
    """Every rank's encode needs the step's pruned samples and pack plan: a process decodes
    each once (the samples here by pack, carried in finalize's task; the plan by the first
    encode); under a new cut of the same step number they are read again. The oracle: which
    step values were read, and the rollout ids each read gave."""
    store, _ = shipped_step
    ship.finalize(run_id, 0)
    for rank in range(RANKS):
        ship.encode(run_id, 0, rank)
    assert "pruned" not in values_read and values_read.count("plan") == 1, "decoded once a process"

    def rollout_ids() -> list[str]:
        """The rollout ids of the pruned samples a new task of the step gets."""
        return sorted(ship._pruned(ship.StepContext(run_id, 0)).labels["rollout_id"])

    assert rollout_ids() == ["a", "b", "c"]
    stored = msgpack.unpackb(client.get(store.keys.step(0, "pruned")), raw=False)
    only_a = Cohort.from_wire(stored["samples"]).where("rollout_id", "a")
    store.put_step_value(0, "pruned", msgpack.packb({"samples": only_a.to_wire()}, use_bin_type=True))
    values_read.clear()
    assert rollout_ids() == ["a", "b", "c"], "the same cut's"
    assert "pruned" not in values_read
    manifest = StepManifest.from_bytes(store.get_step_value(0, "manifest"))
    recut = dataclasses.replace(manifest, cut_id=uuid.uuid4().hex, cut_time=manifest.cut_time + 1)
    store.put_step_value(0, "manifest", recut.to_bytes())
    assert rollout_ids() == ["a"], "the new cut's, read again"
