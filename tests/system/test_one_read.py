"""Each rollout's bytes are read from Redis once per step: by the task that prepares its wire
parts before the cut (the encoder then reads those parts, once, and makes the step's sample
lines from them), never by finalize when the producer's facts came with it. The oracle is
Redis's own MONITOR feed of every command, counted per key, over a real run (real workers,
trainer ranks, ZMQ)."""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from pathlib import Path

import pytest
import redis

from orchestrator.producer import RolloutProducer
from tests.support.factories import group
from tests.support.shiprun import metrics_lines, ship, ship_settings
from transport.arrays_blob import pack_arrays
from transport.store import PayloadStore

STEPS, BATCH, GROUP = 3, 16, 4


class CommandFeed:
    """The commands Redis runs that name this run's rollout keys, from a MONITOR connection."""

    def __init__(self, url: str, run_id: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pattern = re.compile(rf"rlship:{re.escape(run_id)}:rollout:([^ :]+(?::wire)?)")
        self.commands: list[tuple[str, list[str]]] = []
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.monitor = self.client.monitor()

    def _listen(self) -> None:
        with self.monitor as feed:
            self.ready.set()
            try:
                for entry in feed.listen():
                    ids = self.pattern.findall(entry["command"])
                    if ids:
                        self.commands.append((entry["command"].split(" ", 1)[0].upper(), ids))
            except (redis.ConnectionError, OSError, ValueError, AttributeError):
                return

    def __enter__(self) -> CommandFeed:
        self.thread.start()
        self.ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.monitor.connection.disconnect()
        self.thread.join(5)
        self.client.close()

    def reads(self, command: str) -> Counter[str]:
        return Counter(rid for name, ids in self.commands if name == command for rid in ids)


@pytest.mark.timeout(240)
def test_each_rollout_is_read_once_and_finalize_reads_none(client, redis_url, run_id, workers, tmp_path):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=STEPS, batch_size=BATCH, group_size=GROUP,
        samples_per_step=4, max_off_policy_steps=100,
    )  # fmt: skip
    producer = RolloutProducer.for_run(client, settings, admitted=False)
    written = []
    for index in range(STEPS * BATCH // GROUP):
        rollouts = group(f"g{index}", [1.0, 0.0, 1.0, 0.5], num_output_tokens=8 + index)
        producer.produce(rollouts)
        written += [record.rollout_id for record, _ in rollouts]
    # One rollout written over after the producer's check, with a blob of another size: the
    # one finalize must read (and drops: one token short of its record).
    store = PayloadStore(client, run_id)
    record, arrays = group("g1", [1.0, 0.0, 1.0, 0.5], num_output_tokens=9)[2]
    damaged = {**arrays, "input_ids": arrays["input_ids"][:-1]}
    client.set(store.keys.rollout(record.rollout_id), pack_arrays(damaged), keepttl=True)

    with CommandFeed(redis_url, run_id) as feed:
        ship(settings, produce=False)

    records = metrics_lines(settings)
    assert [int(r["step"]) for r in records] == list(range(STEPS))
    reads = feed.reads("MGET") + feed.reads("GET")
    arrays_read = {rid: n for rid, n in reads.items() if not rid.endswith(":wire")}
    wires_read = {rid.removesuffix(":wire"): n for rid, n in reads.items() if rid.endswith(":wire")}
    sized = feed.reads("STRLEN")
    shipped = set(written) - {record.rollout_id}
    # The damaged rollout is read by prepare and again by finalize (its size changed): the
    # one rollout read twice, and the only one that finalize reads. The first step's last
    # groups may be cut (and encoded) before their prepare task ran: their encoder then
    # reads them itself, a second read of theirs only; later steps' groups were prepared
    # long before their cuts.
    first_step = set(written[:BATCH])
    once = {rid: n for rid, n in arrays_read.items() if rid not in first_step}
    assert once == dict.fromkeys(set(written) - first_step, 1), "every later rollout's arrays once"
    assert arrays_read[record.rollout_id] == 2
    assert all(1 <= arrays_read[rid] <= 2 for rid in first_step)
    assert set(wires_read) == shipped and set(wires_read.values()) == {1}, "the shipped ones' wire parts once"
    assert set(sized) == set(written) and set(sized.values()) == {1}, "finalize asked each one's size, once"
    assert sum(r["accounting/dropped_by_workers"] for r in records[-1:]) == 1.0
    # The sample lines came from the encoders' reads: 4 a step, each a shipped rollout's
    # tokens exactly as written.
    by_id = {r.rollout_id: a for index in range(STEPS * BATCH // GROUP)
             for r, a in group(f"g{index}", [1.0, 0.0, 1.0, 0.5], num_output_tokens=8 + index)}  # fmt: skip
    for step in range(STEPS):
        lines = [json.loads(line) for line in (Path(settings.output_dir) / "samples" / f"step_{step}.jsonl")
                 .read_text().splitlines()]  # fmt: skip
        assert len(lines) == 4
        for line in lines:
            assert line["rollout_id"] in shipped
            assert line["input_ids"] == by_id[line["rollout_id"]]["input_ids"].tolist()
