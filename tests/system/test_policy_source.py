"""Policy progress from external trainers, and producers admitted by the run.

- The broadcast-directory scanner against files written by hand (prime-rl's convention:
  `step_{n}/STABLE`; a directory without STABLE is a broadcast still being written).
- The run's sources (Redis, broadcasts, both) and the mirror producers read.
- Producers: refused past the backlog limit, by a held gate, when stale or too large;
  concurrent producers never overshoot; a timeout waits until admitted.
- End to end: `--trainers external`, broadcasts, stock trainer ranks (tests/support/stock_peers.py),
  a `rlship produce` process running throughout. While rank 0 stops announcing for about
  a minute the gate holds and says which source and version it waits for, and the run's
  Redis memory stays flat; when it announces again the gate releases and every step
  reaches every rank once, in order.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.policy import NO_VERSION, PolicyVersion, broadcast_version
from orchestrator.producer import AdmissionRefused, AsyncRolloutProducer, RolloutProducer
from orchestrator.settings import RunSettings, settings_to_env
from tests.support.factories import group
from tests.support.processes import REPO, python_command
from tests.support.shiprun import run_orchestrator, ship_settings
from tests.support.stock_peers import (
    pause_announcements,
    read_record,
    resume_announcements,
    start_stock_ranks,
)
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys
from transport.store import PayloadStore

pytestmark = pytest.mark.timeout(300)


def stable(directory: Path, name: str) -> None:
    (directory / name).mkdir(parents=True, exist_ok=True)
    (directory / name / "STABLE").touch()


# -- the broadcast directory ---------------------------------------------------------------


def test_broadcast_version_is_the_highest_step_with_stable(tmp_path):
    broadcasts = tmp_path / "broadcasts"
    assert broadcast_version(broadcasts) == NO_VERSION, "no directory yet"
    broadcasts.mkdir()
    assert broadcast_version(broadcasts) == NO_VERSION, "nothing announced yet"
    stable(broadcasts, "step_0")
    assert broadcast_version(broadcasts) == 0
    (broadcasts / "step_3").mkdir()  # weights still being written: not announced
    (broadcasts / "step_3" / "model.safetensors").write_bytes(b"\0" * 16)
    assert broadcast_version(broadcasts) == 0
    stable(broadcasts, "step_2")
    stable(broadcasts, "step_9")
    stable(broadcasts, "step_10")  # numbers, not names: 10 > 9
    assert broadcast_version(broadcasts) == 10
    for name in ("step_x", "step_11a", "steps_12", "step_-13", "step_", "step_١٤", "STEP_15"):
        stable(broadcasts, name)
    (broadcasts / "step_16").write_text("a file, not a broadcast")
    assert broadcast_version(broadcasts) == 10, "names that are not step_{n} are not broadcasts"
    (broadcasts / "step_3" / "STABLE").touch()
    assert broadcast_version(broadcasts) == 10


def test_policy_source_and_directory_defaults(tmp_path, monkeypatch):
    builtin = RunSettings(output_dir=tmp_path)
    external = RunSettings(output_dir=tmp_path, trainers="external")
    assert (builtin.policy_source, external.policy_source) == ("redis", "broadcasts")
    assert external.broadcast_dir == tmp_path / "broadcasts"
    named = RunSettings(output_dir=tmp_path, policy_source="both", broadcast_dir=tmp_path / "b")
    assert (named.policy_source, named.broadcast_dir) == ("both", tmp_path / "b")
    # Derived values follow what they derive from in a copy, given ones stay.
    moved = external.with_changes(output_dir=tmp_path / "elsewhere", trainers="builtin")
    assert (moved.policy_source, moved.broadcast_dir) == ("redis", tmp_path / "elsewhere" / "broadcasts")
    assert named.with_changes(output_dir=tmp_path / "x").broadcast_dir == tmp_path / "b"
    for name, value in settings_to_env(external).items():  # as a child process gets them
        monkeypatch.setenv(name, value)
    child = RunSettings()
    assert (child.policy_source, child.broadcast_dir) == ("broadcasts", tmp_path / "broadcasts")
    assert not {"policy_source", "broadcast_dir"} & child.model_fields_set, "derived in the child too"


def test_rlship_run_help_names_the_policy_source():
    out = subprocess.run(
        python_command("run", "--help"), cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "--policy-source" in out and "--broadcast-dir" in out
    assert "STABLE" in out


@pytest.mark.parametrize(("source", "expected"), [("redis", 5), ("broadcasts", 3), ("both", 5)], ids=str)
def test_each_source_and_the_mirror(source, expected, client, redis_url, run_id, tmp_path):
    settings = RunSettings(
        run_id=run_id, redis_url=redis_url, output_dir=tmp_path, trainers="external", policy_source=source
    )
    keys = RunKeys(run_id)
    client.set(keys.policy_version, 5)
    stable(settings.broadcast_dir, "step_3")

    async def follow() -> int:
        aclient = aioredis.Redis.from_url(redis_url)
        try:
            return await PolicyVersion(settings, aclient).update()
        finally:
            await aclient.aclose()

    assert asyncio.run(follow()) == expected
    assert int(client.get(keys.known_policy_version)) == expected, "mirrored for producers"
    assert 0 < client.ttl(keys.known_policy_version) <= DEFAULT_TTL_SECONDS
    assert RolloutProducer(client, run_id).policy_version() == expected
    client.delete(keys.policy_version, keys.known_policy_version)


# -- producer admission ---------------------------------------------------------------------


def admission_settings(run_id: str, redis_url: str, **overrides) -> RunSettings:
    values = {"run_id": run_id, "redis_url": redis_url, "batch_size": 8, "group_size": 4, "seq_len": 64}
    return RunSettings(**{**values, **overrides})


@pytest.fixture
def backlog_at_limit(client, redis_url, run_id) -> tuple[RunSettings, RolloutProducer]:
    """A run that allows 8 rollouts outstanding and its producer, which has written 8 (two
    groups) that the orchestrator has not taken yet."""
    settings = admission_settings(run_id, redis_url, max_outstanding_rollouts=8)
    producer = RolloutProducer.for_run(client, settings)
    producer.produce(group("a", [1.0, 0.0, 1.0, 0.0]))
    producer.produce(group("b", [1.0, 0.0, 1.0, 0.0]))
    return settings, producer


def test_backlog_refusal_writes_nothing_and_passes_once_accounted(client, run_id, backlog_at_limit):
    _, producer = backlog_at_limit
    keys = RunKeys(run_id)
    with pytest.raises(AdmissionRefused, match=r"backlog.*8 rollouts outstanding.*limit of 8") as refused:
        producer.produce(group("c", [1.0, 0.0, 1.0, 0.0]))
    assert refused.value.reason == "backlog"
    assert client.xlen(keys.rollout_stream) == 8 and not client.exists(keys.rollout("c-r0"))
    client.set(keys.run_key("accounted"), 4)  # the orchestrator took one group
    producer.produce(group("c", [1.0, 0.0, 1.0, 0.0]))
    assert client.xlen(keys.rollout_stream) == 12
    PayloadStore(client, run_id).delete_all_rollouts()


def test_gate_held_stale_and_too_large_are_named(client, redis_url, run_id):
    settings = admission_settings(run_id, redis_url, max_off_policy_steps=3)
    keys = RunKeys(run_id)
    producer = RolloutProducer.for_run(client, settings)
    # The trainers hold version 0; step 5 needs version 4 (max_async_level 1): the gate
    # leaves room for the step's batch and a call less one rollout (8 + 8 - 1), no more.
    client.set(keys.run_key("next_step"), 5)
    client.set(keys.known_policy_version, 0)
    for name in "abc":
        producer.produce(group(name, [1.0, 0.0, 1.0, 0.0], policy_version=4))
    with pytest.raises(
        AdmissionRefused,
        match=r"gate_held.*12 rollouts.*the 15 .*policy version is 0.*step 5 needs version 4",
    ):
        producer.produce(group("d", [1.0, 0.0, 1.0, 0.0], policy_version=4))
    client.set(keys.known_policy_version, 4)  # step 5 may be cut now: a batch more fits
    producer.produce(group("d", [1.0, 0.0, 1.0, 0.0], policy_version=4))
    with pytest.raises(AdmissionRefused, match=r"would_be_stale.*version 1, older than 2.*step 5") as stale:
        producer.produce(group("e", [1.0, 0.0, 1.0, 0.0], policy_version=1), timeout=30)
    assert stale.value.reason == "would_be_stale"
    with pytest.raises(AdmissionRefused, match=r"too_large.*9 rollouts.*at most 8") as large:
        groups = [
            group(f"f{i}", [1.0, 0.0, 1.0, 0.0][: 4 if i < 2 else 1], policy_version=4) for i in range(3)
        ]
        producer.produce([r for g in groups for r in g], timeout=30, partial_groups=True)
    assert large.value.reason == "too_large"
    assert client.xlen(keys.rollout_stream) == 16
    PayloadStore(client, run_id).delete_all_rollouts()


def test_a_step_cut_between_the_read_and_the_call_is_worked_out_again(client, redis_url, run_id, monkeypatch):
    """A producer works the gate's room out from the next step it read; a step cut before
    its call lands frees a batch of backlog (counted at the call) and takes a step of room
    (not): the call is judged against the room after the cut."""
    settings = admission_settings(run_id, redis_url)
    keys = RunKeys(run_id)
    producer = RolloutProducer.for_run(client, settings)
    # Version 4 lets step 5 be cut (it needs 4), not step 6 (it needs 5): the room is
    # 8 + 8 + 8 - 1 = 23 at next step 5, and 8 + 8 - 1 = 15 once step 5 is cut.
    client.set(keys.run_key("next_step"), 5)
    client.set(keys.known_policy_version, 4)
    client.set(keys.run_key("produced"), 20)
    client.set(keys.run_key("accounted"), 0)
    read = client.mget

    def read_then_cut(*args, **kwargs):
        values = read(*args, **kwargs)
        monkeypatch.setattr(client, "mget", read)
        pipe = client.pipeline(transaction=True)  # the orchestrator's cut of step 5
        pipe.incr(keys.run_key("next_step")).incrby(keys.run_key("accounted"), 8).execute()
        return values

    monkeypatch.setattr(client, "mget", read_then_cut)
    # 12 outstanding after the cut and 4 more: 16, past 15 (though within the 23 read).
    with pytest.raises(AdmissionRefused, match=r"gate_held.*12 rollouts.*the 15 .*step 6 needs version 5"):
        producer.produce(group("late", [1.0, 0.0, 1.0, 0.0], policy_version=4))
    assert int(client.get(keys.run_key("produced"))) == 20 and client.xlen(keys.rollout_stream) == 0
    assert not client.exists(keys.rollout("late-r0"))
    client.set(keys.known_policy_version, 5)  # step 6 may be cut: a batch more fits
    producer.produce(group("late", [1.0, 0.0, 1.0, 0.0], policy_version=4))
    assert int(client.get(keys.run_key("produced"))) == 24 and client.xlen(keys.rollout_stream) == 4
    PayloadStore(client, run_id).delete_all_rollouts()


def test_a_timeout_waits_until_admitted(client, redis_url, run_id, backlog_at_limit):
    settings, producer = backlog_at_limit
    keys = RunKeys(run_id)
    started = time.monotonic()
    with pytest.raises(AdmissionRefused, match="backlog"):
        producer.produce(group("c", [1.0, 0.0, 1.0, 0.0]), timeout=0.5)
    assert time.monotonic() - started >= 0.5

    accounted = threading.Timer(1.0, client.set, (keys.run_key("accounted"), 4))
    accounted.start()
    started = time.monotonic()
    producer.produce(group("c", [1.0, 0.0, 1.0, 0.0]), timeout=30)
    assert time.monotonic() - started >= 0.9, "it waited for the room"
    assert client.exists(keys.rollout("c-r3"))

    async def async_refused() -> None:
        aclient = aioredis.Redis.from_url(redis_url)
        try:
            with pytest.raises(AdmissionRefused, match="backlog"):
                await AsyncRolloutProducer.for_run(aclient, settings).produce(
                    group("d", [1.0, 0.0, 1.0, 0.0])
                )
        finally:
            await aclient.aclose()

    asyncio.run(async_refused())
    PayloadStore(client, run_id).delete_all_rollouts()


def produce_flat_out(settings: RunSettings, name: str, seconds: float) -> None:
    """One producer process: a group as often as it is admitted, for `seconds`."""
    producer = RolloutProducer.for_run(redis.Redis.from_url(settings.redis_url), settings)
    deadline = time.monotonic() + seconds
    index = 0
    while time.monotonic() < deadline:
        try:
            producer.produce(group(f"{name}-{index}", [1.0, 0.0, 1.0, 0.0]))
            index += 1
        except AdmissionRefused:
            pass


def test_concurrent_producers_never_overshoot(client, redis_url, run_id):
    """Four producer processes race for the room an orchestrator frees a group at a time;
    the backlog never passes the limit, read atomically at every sample."""
    settings = admission_settings(run_id, redis_url, max_outstanding_rollouts=20, group_size=4)
    keys = RunKeys(run_id)
    context = multiprocessing.get_context("spawn")
    producers = [context.Process(target=produce_flat_out, args=(settings, f"p{i}", 6.0)) for i in range(4)]
    for process in producers:
        process.start()
    backlogs = []
    try:
        while any(process.is_alive() for process in producers):
            pipe = client.pipeline(transaction=True)
            pipe.get(keys.run_key("produced"))
            pipe.get(keys.run_key("accounted"))
            produced, accounted = (int(v or 0) for v in pipe.execute())
            backlogs.append(produced - accounted)
            if produced - accounted >= 16:
                client.incrby(keys.run_key("accounted"), 4)  # as the orchestrator, a group taken
            time.sleep(0.002)
    finally:
        for process in producers:
            process.join(30)
    produced = int(client.get(keys.run_key("produced")))
    assert max(backlogs) <= settings.outstanding_limit
    assert produced - int(client.get(keys.run_key("accounted"))) <= settings.outstanding_limit
    assert client.xlen(keys.rollout_stream) == produced > 5 * settings.outstanding_limit, "they raced a lot"
    PayloadStore(client, run_id).delete_all_rollouts()


# -- end to end ---------------------------------------------------------------------------------

STEPS = 12
PAUSE_SECONDS = 60.0
HELD = re.compile(
    r"step (\d+) held by the policy gate: waiting for version (\d+) from broadcasts (\S+) \(have (-?\w+)\)"
)


def payload_keys(client: redis.Redis, keys: RunKeys) -> int:
    return sum(1 for _ in client.scan_iter(match=keys.rollout("*"), count=1000))


def run_memory(client: redis.Redis, keys: RunKeys) -> int:
    """The bytes the run's own keys take (MEMORY USAGE of each, every element counted): the
    server is shared, and other runs' keys come and go."""
    held = client.scan_iter(match=keys.prefix + "*", count=1000)
    return sum(client.memory_usage(key, samples=0) or 0 for key in held)


def test_external_trainers_gate_holds_while_unannounced_and_memory_stays_flat(
    client, redis_url, run_id, workers, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="rlship.orchestrator")
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=STEPS, trainers="external", policy_source="broadcasts",
        batch_size=16, group_size=4, seq_len=512, samples_per_step=0, stall_seconds=120.0,
    )  # fmt: skip
    assert settings.first_step == 1, "external trainers number steps as prime-rl does"
    keys = RunKeys(run_id)
    status = f"rlship:{run_id}:status"
    records, peers = start_stock_ranks(settings, [STEPS] * settings.ranks)
    producer_log = tmp_path / "producer.log"
    producer = subprocess.Popen(
        python_command("produce"),
        env={**os.environ, **settings_to_env(settings), "PYTHONPATH": str(REPO)},
        cwd=REPO,
        stdout=open(producer_log, "ab"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
    )
    outcome: dict[str, object] = {}
    orchestrator = threading.Thread(
        target=lambda: outcome.update(result=asyncio.run(run_orchestrator(settings, timeout=280)))
    )
    samples: list[tuple[int, ...]] = []  # stream, payload keys, run memory, produced, backlog
    try:
        orchestrator.start()
        published = f"rlship:{run_id}:published"
        deadline = time.monotonic() + 60
        while client.hlen(published) < 3:
            assert time.monotonic() < deadline and orchestrator.is_alive(), "the run started shipping"
            time.sleep(0.05)
        pause_announcements(records[0])

        deadline = time.monotonic() + 60
        while not client.hget(status, "policy_gate"):
            assert time.monotonic() < deadline and orchestrator.is_alive(), "the gate came to hold"
            time.sleep(0.1)
        held = HELD.search(client.hget(status, "policy_gate").decode())
        assert held, client.hget(status, "policy_gate")
        step, needed, directory, have = int(held[1]), int(held[2]), held[3], held[4]
        assert directory == str(settings.broadcast_dir)
        assert needed == step - 1 - settings.max_async_level, "prime-rl's gate for its step s: s - 1 - level"
        assert int(have) == broadcast_version(settings.broadcast_dir) < needed
        assert client.hlen(published) < STEPS

        paused_at = time.monotonic()
        while time.monotonic() - paused_at < PAUSE_SECONDS:
            produced_now, accounted = (
                int(v or 0) for v in client.mget(keys.run_key("produced"), keys.run_key("accounted"))
            )
            samples.append((
                client.xlen(keys.rollout_stream), payload_keys(client, keys), run_memory(client, keys),
                produced_now, produced_now - accounted,
            ))  # fmt: skip
            time.sleep(1.0)
        assert client.hget(status, "policy_gate"), "still held after the pause"
        assert producer.poll() is None, "the producer waited instead of crashing"
        resume_announcements(records[0])

        orchestrator.join(240)
        assert not orchestrator.is_alive() and "result" in outcome, "the run ended after the resume"
        for peer in peers:
            assert peer.wait(60) == 0, "every stock rank got every step"
    finally:
        resume_announcements(records[0])
        producer.terminate()
        producer.wait(30)
        for peer in peers:
            peer.kill()
        orchestrator.join(60)
        PayloadStore(client, run_id).delete_all_rollouts()

    for record in records:
        steps = [r["topic_step"] for r in read_record(record)]
        assert steps == list(range(1, STEPS + 1)), "once each, in order"
    log = caplog.text
    assert f"step {step} held by the policy gate: waiting for version {needed} from broadcasts" in log
    assert f"step {step}: the policy gate opened after" in log
    reports = [m for m in caplog.messages if m.startswith(f"step {step} held by the policy gate")]
    assert len(reports) >= PAUSE_SECONDS / 10, "reported every few seconds while held"
    waits = producer_log.read_text()
    assert "producer waits: produce refused (gate_held)" in waits or "(backlog)" in waits, waits[-2000:]

    stream, payloads, memory, produced, backlog = (list(c) for c in zip(*samples, strict=True))
    print(
        f"held {len(samples)} s at step {step} (version {needed} awaited, {have} announced): stream "
        f"{min(stream)}..{max(stream)} entries, payload keys {min(payloads)}..{max(payloads)}, "
        f"the run's keys {min(memory)}..{max(memory)} B, produced {produced[0]}..{produced[-1]}, "
        f"backlog {max(backlog)}"
    )
    # Bounds from the settings: the backlog is what the held gate leaves room for (a batch
    # and a call less one rollout), well under the backlog limit; payloads held are the
    # backlog plus the steps cut and not yet released; nothing is produced while the gate
    # holds, so the stream stands still; the memory the run's keys take moves by less than
    # one more backlog of payloads.
    held_room = settings.batch_size + max(settings.batch_size, settings.group_size) - 1
    assert max(backlog) <= held_room < settings.outstanding_limit
    in_flight = (settings.max_async_level + 3) * settings.batch_size
    assert max(payloads) <= settings.outstanding_limit + in_flight
    assert produced[-1] == produced[0] and max(stream) == min(stream), "not one rollout while held"
    backlog_bytes = settings.outstanding_limit * settings.seq_len * (4 + 1 + 4)  # ids, mask, logprobs
    assert max(memory) - min(memory) < backlog_bytes
