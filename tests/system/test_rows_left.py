"""No rows file is left that no key points at (issue 38, item 8): `rlship produce` writes a
group's rows files before the run admits it, so it deletes them itself when the run does not
take the group (finished, never admissible, or the producer stopped with it in hand); and a
run that ends closes admission before it releases what it holds, so no producer's write lands
after that release. Real Redis and real files, no worker: the runs are stored by hand, or
resumed with every step already followed, so `Orchestrator.run` goes straight to its end.

The oracle is the run's directory of rows files and its payload keys, listed afterwards."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from orchestrator.commands.produce import SyntheticWorkload, run_producer
from orchestrator.orchestrator import Orchestrator
from orchestrator.settings import RunSettings
from tests.support.stored_runs import store_run
from transport.connection import connect_redis_async
from transport.keys import RunKeys
from transport.payload_segments import rollout_rows_path
from transport.store import PayloadStore
from transport.zmq_sockets import free_port_pair

pytestmark = pytest.mark.timeout(60)


def moe_settings(run_id: str, redis_url: str, tmp_path, **overrides) -> RunSettings:
    """A small moe run: every rollout `rlship produce` makes has its rows file."""
    values = {
        "run_id": run_id,
        "redis_url": redis_url,
        "steps": 1,
        "batch_size": 4,
        "group_size": 2,
        "seq_len": 128,
        "workload": "moe",
        "trainers": "external",
        "max_off_policy_steps": 100,
        "zmq_port": free_port_pair(),
        "output_dir": tmp_path,
    }
    return RunSettings(**{**values, **overrides})


def rows_files(settings: RunSettings) -> list[str]:
    directory = settings.run_rows().directory
    return sorted(p.name for p in directory.rglob("*") if p.is_file()) if directory.exists() else []


def test_a_group_a_finished_run_refuses_leaves_no_rows_file(client, redis_url, run_id, tmp_path):
    settings = moe_settings(run_id, redis_url, tmp_path)
    store_run(client, settings, shipped=1, finished=True)
    assert run_producer(settings, groups=1) == 0
    assert rows_files(settings) == [], "the refused group's rows files are deleted"


def test_a_group_skipped_as_stale_leaves_no_rows_file(client, redis_url, run_id, tmp_path):
    settings = moe_settings(run_id, redis_url, tmp_path, max_off_policy_steps=0)
    store_run(client, settings)
    # The run's next step is far past policy version 0, the one the producer stamps: stale.
    client.set(RunKeys(run_id).next_step, 50)
    assert run_producer(settings, groups=2) == 2, "both groups are made, and skipped"
    assert rows_files(settings) == [], "the skipped groups' rows files are deleted"
    assert PayloadStore(client, run_id).held_keys() == []


def test_a_producer_stopped_with_a_group_in_hand_leaves_no_rows_file(client, redis_url, run_id, tmp_path):
    settings = moe_settings(run_id, redis_url, tmp_path)
    store_run(client, settings)
    # A backlog at the run's limit: the run admits nothing, the producer waits with its group.
    client.set(RunKeys(run_id).produced, settings.outstanding_limit)
    stop = threading.Event()
    producer = threading.Thread(target=run_producer, args=(settings,), kwargs={"stop": stop})
    producer.start()
    deadline = time.monotonic() + 30
    while len(rows_files(settings)) < settings.group_size and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(rows_files(settings)) == settings.group_size, "the group in hand has its rows files"
    stop.set()
    producer.join(30)
    assert not producer.is_alive()
    assert rows_files(settings) == [], "the group it held when stopped: its rows files are deleted"


def test_a_producer_right_after_the_end_of_run_release_is_refused_and_leaves_nothing(
    client, redis_url, run_id, tmp_path
):
    """A producer's call made the moment the ending run has released what it held (the gap in
    which one was admitted when the run was marked finished only after that release)."""
    settings = moe_settings(run_id, redis_url, tmp_path)
    keys = RunKeys(run_id)
    # Every step followed, the run not yet marked finished: a restarted orchestrator only ends it.
    client.set(keys.followed, settings.step_numbers[-1])
    client.set(keys.next_step, settings.step_numbers.stop)
    written: list[int] = []

    async def end() -> None:
        aclient = connect_redis_async(redis_url)
        try:
            orchestrator = Orchestrator(settings, aclient)
            release = orchestrator.releases.unshipped

            async def release_then_produce() -> int:
                released = await release()
                written.append(await asyncio.to_thread(run_producer, settings, 1))
                return released

            orchestrator.releases.unshipped = release_then_produce
            await orchestrator.run()
        finally:
            await aclient.aclose()

    asyncio.run(end())
    assert written == [0], "the run took a group after its end-of-run release"
    assert client.exists(keys.finished)
    assert PayloadStore(client, run_id).held_keys() == []
    assert rows_files(settings) == []


def test_a_group_whose_files_the_run_end_removed_while_it_was_made_leaves_no_rows_file(
    client, redis_url, run_id, tmp_path, monkeypatch
):
    """The end of a run removes its rows directory whole; a producer writing a group's files
    meanwhile finds the first ones gone: the run refuses the group by its checks (nothing of
    it written) and the producer deletes the files that are left (seen once in
    `test_trainer_replay`'s MoE case, under load)."""
    settings = moe_settings(run_id, redis_url, tmp_path, group_size=4)
    store_run(client, settings)
    made = SyntheticWorkload.group

    def made_while_the_run_ended(self, write: bool = True):
        group = made(self, write)
        for record, _ in group[:2]:  # the run's end removed these two, then the producer wrote on
            rollout_rows_path(settings.payload_root, run_id, record.rollout_id).unlink()
        return group

    monkeypatch.setattr(SyntheticWorkload, "group", made_while_the_run_ended)
    assert run_producer(settings, groups=1) == 1
    assert PayloadStore(client, run_id).held_keys() == [], "nothing of the group was written"
    assert rows_files(settings) == [], "the rows files the run's end had not removed are deleted"
