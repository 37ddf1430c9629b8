"""Groups of verifiers 0.4.0 episodes through rlship end to end: EpisodeProducer into real
Redis, the session's Celery workers, and trainer ranks that receive as prime-rl's stock
ones do. What every rank's payload file decodes to (as a 559b447 rank decodes it:
tests/support/prime_559b447_samples.py, from prime-rl's source) must be, sequence by
sequence, the sample prime-rl 559b447's own train sink makes of the same episodes: token
ids, loss mask, advantages, logprobs, temperatures, loss weights, env name, token types,
routed experts. On wire 0f59b24 the routed experts go by handle, and the rows each stock
rank reads with `pread` must be prime-rl's. A bad group is refused whole, nothing of it
written."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

vf = pytest.importorskip("verifiers.v1")

from verifiers.v1.serve.delta import dump, pack  # noqa: E402

from orchestrator.rollout_checks import RolloutRejected  # noqa: E402
from rlship import ZMQMicroBatchReceiver  # noqa: E402
from rlship.verifiers import AsyncEpisodeProducer, EpisodeProducer  # noqa: E402
from tests.support import episodes as build  # noqa: E402
from tests.support.prime_559b447_samples import (  # noqa: E402
    MicroBatch,
    PrimeSample,
    decode_micro_batches,
    group_samples,
    prune_zero_advantages,
    routed_rows,
)
from tests.support.processes import rlship  # noqa: E402
from tests.support.runs import run_arguments  # noqa: E402
from tests.support.shiprun import open_policy_gate, ship, ship_settings  # noqa: E402
from tests.support.stock_peers import WIRE_0F59B24, read_record, start_stock_ranks  # noqa: E402
from tests.system.test_side_arrays_by_handle import ship_to_0f59b24_ranks  # noqa: E402
from transport.connection import connect_redis_async  # noqa: E402
from transport.keys import RunKeys  # noqa: E402
from transport.zmq_sockets import free_port_pair  # noqa: E402

pytestmark = pytest.mark.timeout(240)
STEPS = 2
TEMPERATURE = 0.8


def groups_of_every_kind(run_id: str, rng: np.random.Generator, round_: int) -> list[list[vf.Episode]]:
    """Two episodes a group, every kind: forked, given credit with loss streams, multimodal,
    a judge that does not train, an errored trace, multi-turn with tools, single-turn; MoE
    throughout (routed experts on every node)."""

    def group(name: str, traces: list[list[vf.Trace]], env: str = "math") -> list[vf.Episode]:
        return [build.episode(t, f"{name}-{round_}", env=env, run_id=run_id) for t in traces]

    given = [build.multi_turn_tools(rng, 1.0, routed=True), build.forked(rng, 0.0, routed=True)]
    for trace in given:
        sampled = sum(sum(node.mask) for node in trace.nodes)
        build.with_advantages(trace, np.linspace(-1.0, 1.0, sampled).round(3).tolist())
        build.with_loss_weights(trace, ("ce", "ref_kl"))
    return [
        group("forked", [[build.forked(rng, r, routed=True)] for r in (1.0, 0.0)]),
        group("given", [[trace] for trace in given], env="tools"),
        group("image", [[build.multimodal(rng, r, routed=True)] for r in (1.0, 0.0)]),
        group("judged", [build.judged(rng, r, routed=True) for r in (1.0, 0.0)]),
        group("errored", [[build.errored(rng, routed=True)], [build.single_turn(rng, 1.0, routed=True)]]),
        group("tools", [[build.multi_turn_tools(rng, r, routed=True)] for r in (0.5, 0.0)], env="tools"),
        group("single", [[build.single_turn(rng, r, routed=True)] for r in (1.0, 0.25)]),
    ]


def file_micro_batches(output_dir: Path) -> list[MicroBatch]:
    """Every micro-batch of every rank's payload file, as a prime-rl 559b447 rank decodes it."""
    paths = sorted(Path(output_dir, "rollouts").glob("step_*/rank_*.bin"))
    return [mb for path in paths for mb in decode_micro_batches(path.read_bytes())]


def values(field) -> list | None:
    """A decoded field as a list (rlship's receivers decode arrays, prime-rl's lists)."""
    return field.tolist() if isinstance(field, np.ndarray) else field


def assert_decodes_as(mb, span: slice, experts, sample: PrimeSample) -> None:
    def f32(given) -> list[float]:
        return np.asarray(given, dtype=np.float32).astype(float).tolist()

    mask = np.asarray(sample.mask)
    assert values(mb.loss_mask)[span] == sample.mask
    assert values(mb.advantages)[span] == f32(sample.advantages)
    assert values(mb.inference_logprobs)[span] == f32(sample.logprobs)
    assert values(mb.temperatures)[span] == sample.temperatures  # the env's temperature, as given
    assert set(mb.env_names[span]) == {sample.env_name}
    for name in ("ce_weights", "ref_kl_weights", "ref_logprobs"):
        expected, got = getattr(sample, name), values(getattr(mb, name))
        if expected is not None:
            assert got is not None and got[span] == f32(expected), name
        else:
            assert got is None or got[span] == [0.0] * len(mask), name
    # rl weights: prime-rl's trainer reads an absent stream as 1.0; the loss counts them on
    # the loss mask only (rlship writes 0 off it).
    rl = np.ones(len(mask)) if sample.rl_weights is None else np.asarray(sample.rl_weights)
    assert np.asarray(values(mb.rl_weights)[span])[mask].tolist() == f32(rl[mask])
    types = values(mb.mm_token_type_ids)[span] if mb.mm_token_type_ids is not None else None
    assert (types or [0] * len(mask)) == (sample.mm_token_type_ids or [0] * len(mask))
    assert experts is not None and np.array_equal(experts, sample.routed_experts)


def produce_every_kind(client, settings, seed: int) -> tuple[dict[tuple[int, ...], PrimeSample], set]:
    """Two rounds of groups of every kind written through an EpisodeProducer; what prime-rl
    would ship of them (its samples by token ids) and what it would prune."""
    producer = EpisodeProducer.for_run(client, settings, admitted=False, temperature=TEMPERATURE)
    rng = np.random.default_rng(seed)
    oracle: dict[tuple[int, ...], PrimeSample] = {}
    pruned: set[tuple[int, ...]] = set()
    for round_ in range(2):
        for episodes in groups_of_every_kind(settings.run_id, rng, round_):
            for sample in group_samples(episodes, temperature=TEMPERATURE):
                if prune_zero_advantages(sample):
                    oracle[tuple(sample.token_ids)] = sample
                else:
                    pruned.add(tuple(sample.token_ids))
            producer.produce(episodes)
    assert producer.errored_traces == 2 and producer.not_trainable_traces == 4
    assert pruned, "the errored group's lone survivor has advantage 0: prime-rl ships none of it"
    return oracle, pruned


def assert_shipped_as_prime_rl(micro_batches, oracle: dict, pruned: set, at_least: int) -> None:
    """Every sequence of the micro-batches is one prime-rl would ship, once, decoded as its
    sample; and every kind shipped."""
    seen: set[tuple[int, ...]] = set()
    for mb in micro_batches:
        rows, start = routed_rows(mb), 0
        for length in values(mb.sequence_lengths):
            span = slice(start, start + length)
            start += length
            if set(mb.env_names[span]) == {"padding"}:
                continue
            key = tuple(values(mb.input_ids)[span])
            assert key not in pruned and key in oracle, "every sequence shipped is one prime-rl would ship"
            assert key not in seen, "once"
            seen.add(key)
            assert_decodes_as(mb, span, None if rows is None else rows[span], oracle[key])
    assert len(seen) >= at_least
    shipped = [oracle[key] for key in seen]
    assert any(s.mm_token_type_ids for s in shipped), "a multimodal branch shipped"
    assert any(s.ce_weights for s in shipped), "given credit with loss streams shipped"
    assert any(np.count_nonzero(s.logprobs) > sum(s.mask) for s in shipped), "a fork's shared turn as context"


def test_episode_groups_reach_stock_ranks_as_prime_rl_would_make_them(
    client, redis_url, run_id, workers, tmp_path
):
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=STEPS, transport="fs", trainers="external",
        batch_size=8, group_size=2, max_off_policy_steps=100, wire="prime-rl-559b447",
    )  # fmt: skip
    open_policy_gate(settings)
    oracle, pruned = produce_every_kind(client, settings, seed=0)
    records, peers = start_stock_ranks(settings, [STEPS] * settings.ranks)
    try:
        ship(settings, trainers=False, produce=False)
        assert [peer.wait(60) for peer in peers] == [0] * settings.ranks
        assert [len(read_record(record)) for record in records] == [STEPS] * settings.ranks
    finally:
        for peer in peers:
            peer.kill()
    assert_shipped_as_prime_rl(file_micro_batches(tmp_path), oracle, pruned, STEPS * settings.batch_size)


def test_episode_groups_reach_rlships_ranks_as_prime_rl_would_make_them(
    client, redis_url, run_id, workers, tmp_path
):
    """The same over ZMQ to rlship's receivers (ZMQMicroBatchReceiver, each step once and in
    order), what they decode compared as it is."""
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=STEPS, trainers="external", batch_size=8,
        group_size=2, max_off_policy_steps=100,
    )  # fmt: skip
    open_policy_gate(settings)
    oracle, pruned = produce_every_kind(client, settings, seed=5)
    got: dict[int, list] = {rank: [] for rank in range(settings.ranks)}

    def rank(number: int) -> None:
        transport = SimpleNamespace(host=settings.zmq_host, port=settings.zmq_port)
        receiver = ZMQMicroBatchReceiver(
            settings.output_dir, number, settings.start_step, transport,
            run_id=settings.run_id, redis_url=settings.redis_url, ranks=settings.ranks,
        )  # fmt: skip
        try:
            for _ in settings.step_numbers:
                got[number].append(receiver.receive())
        finally:
            receiver.close()

    ranks = [threading.Thread(target=rank, args=(number,), daemon=True) for number in range(settings.ranks)]
    for thread in ranks:
        thread.start()
    ship(settings, trainers=False, produce=False)
    for thread in ranks:
        thread.join(timeout=60)
    assert [len(steps) for steps in got.values()] == [STEPS] * settings.ranks
    micro_batches = [mb for steps in got.values() for step in steps for mb in step]
    assert_shipped_as_prime_rl(micro_batches, oracle, pruned, STEPS * settings.batch_size)


def test_routed_experts_by_handle_reach_stock_0f59b24_ranks_as_prime_rl_makes_them(
    client, redis_url, run_id, workers, tmp_path
):
    """On a wire that takes side arrays by handle, the producer writes each rollout's routed
    experts to its rows file: every stock 0f59b24 rank reads them with `pread`, and the rows
    each read (by trace id: the rollout's id) are the routed experts of prime-rl's sample."""
    settings = ship_settings(
        run_id, redis_url, workers, tmp_path, steps=STEPS, trainers="external", batch_size=8,
        group_size=2, max_off_policy_steps=100, wire=WIRE_0F59B24,
    )  # fmt: skip
    producer = EpisodeProducer.for_run(client, settings, admitted=False)
    rng = np.random.default_rng(3)
    expected: dict[str, str] = {}
    for round_ in range(2):
        for episodes in groups_of_every_kind(run_id, rng, round_):
            samples = {tuple(s.token_ids): s for s in group_samples(episodes) if prune_zero_advantages(s)}
            for record, arrays in producer.produce(episodes).rollouts:
                sample = samples.get(tuple(arrays["input_ids"].tolist()))
                if sample is not None:
                    expected[record.rollout_id] = hashlib.sha256(sample.routed_experts.tobytes()).hexdigest()
    read: dict[str, str] = {}
    for lines in ship_to_0f59b24_ranks(settings):
        for line in lines:
            for trace_id, fields in line["rows"].items():
                assert trace_id not in read, "each rollout's rows read once"
                read[trace_id] = fields["routed_experts"]
    assert len(read) >= STEPS * settings.batch_size
    assert {trace_id: expected.get(trace_id) for trace_id in read} == read


def test_a_bad_group_is_refused_whole_and_nothing_written(client, run_id, tmp_path, redis_url, workers):
    settings = ship_settings(run_id, redis_url, workers, tmp_path, group_size=2, wire=WIRE_0F59B24)
    producer = EpisodeProducer.for_run(client, settings, admitted=False)
    rng = np.random.default_rng(1)
    good = build.episode([build.forked(rng, 1.0, routed=True)], "bad", run_id=run_id)
    bad = build.episode([build.single_turn(rng, 0.0)], "bad", run_id=run_id)
    bad.traces[0].nodes[1].mask = bad.traces[0].nodes[1].mask[:-1]
    with pytest.raises(RolloutRejected) as caught:
        producer.produce([good, bad])
    assert list(caught.value.problems) == [f"{bad.id}/{bad.traces[0].id}"]
    assert "node 1: mask of 7 for 8 token ids" in caught.value.problems[f"{bad.id}/{bad.traces[0].id}"]
    assert not client.exists(producer.rollouts.keys.rollout_stream)
    root = Path(str(settings.payload_root))
    assert not root.exists() or not any(path.is_file() for path in root.rglob("*")), "no rows file"

    with pytest.raises(RolloutRejected, match="has 1 episodes; the run's group_size for its env is 2"):
        producer.produce([good])
    other = build.episode([build.single_turn(rng, 0.0)], "bad", run_id="another-run")
    with pytest.raises(RolloutRejected, match=r"run\.id: 'another-run' is another run's"):
        producer.produce([good, other])


def test_the_async_producer_writes_a_group_of_msgpack_episodes(redis_url, run_id, tmp_path, workers, client):
    """The bytes an env server's episodes pack to (verifiers' serve encoding), on the event loop."""
    settings = ship_settings(run_id, redis_url, workers, tmp_path, group_size=2)
    rng = np.random.default_rng(2)
    episodes = [build.episode([build.forked(rng, r)], "async", run_id=run_id) for r in (1.0, 0.0)]

    async def produce():
        aclient = connect_redis_async(redis_url)
        try:
            producer = AsyncEpisodeProducer.for_run(aclient, settings, admitted=False)
            result = await producer.produce([pack(dump(episode)) for episode in episodes])
            ids = [record.rollout_id for record, _ in result.rollouts]
            return producer, ids, await producer.rollouts.outcome(ids)
        finally:
            await aclient.aclose()

    producer, ids, outcomes = asyncio.run(produce())
    assert len(ids) == 4  # two forked traces, two branches each
    assert {outcome.state for outcome in outcomes.values()} == {"pending"}
    assert client.xlen(producer.rollouts.keys.rollout_stream) == 4


def test_rlship_produce_writes_the_whole_groups_of_episode_files(client, redis_url, run_id, tmp_path):
    """`rlship produce --episodes DIR`: msgpack files as environment servers send episodes,
    several a file, a group's episodes across files; each whole group written, an
    incomplete one named and not written (exit 1)."""
    rng = np.random.default_rng(4)
    one, two, three = (
        [build.episode([build.forked(rng, r)], name, run_id=run_id) for r in (1.0, 0.0)]
        for name in ("one", "two", "three")
    )
    files = tmp_path / "episodes"
    files.mkdir()
    (files / "a.msgpack").write_bytes(b"".join(pack(dump(e)) for e in one))
    (files / "b.msgpack").write_bytes(b"".join(pack(dump(e)) for e in (two[0], three[0], two[1])))
    (files / "notes.txt").write_text("not an episode file: skipped")
    done = rlship(
        "produce", "--run-id", run_id, "--redis-url", redis_url, "--group-size", "2",
        "--output-dir", str(tmp_path / "run"), "--episodes", str(files),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "rlship produce: 2 groups of episodes written" in done.stdout
    assert (
        "group 'three' of env 'math': 1 episodes, fewer than the run's group size: not written" in done.stderr
    )
    entries = client.xrange(RunKeys(run_id).rollout_stream)
    groups = [json.loads(fields[b"record"])["group_id"] for _, fields in entries]
    assert groups == ["one"] * 4 + ["two"] * 4  # forked traces: two branches each

    for data, problem in [
        (b"\x92\x01\x02", "a.msgpack: episode 0: not a verifiers episode"),  # a msgpack array
        (pack(dump(one[0]))[:-3], "a.msgpack: cut short after 0 whole episodes"),  # a partial write
    ]:
        (files / "a.msgpack").write_bytes(data)
        done = rlship(
            "produce", "--run-id", run_id, "--redis-url", redis_url, "--episodes", str(files / "a.msgpack")
        )
        assert done.returncode == 2 and problem in done.stderr, done.stderr


def test_rlship_run_with_the_episodes_workload_ships_every_step(redis_url, tmp_path):
    """`rlship run --workload episodes`: the synthetic producer writes groups of verifiers
    episodes; every step reaches every rank."""
    run_id = f"episodes-{uuid.uuid4().hex[:8]}"
    done = rlship(
        *run_arguments(run_id, 3, tmp_path, free_port_pair()), "--workload", "episodes", "--ranks", "2",
        env={"REDIS_URL": redis_url}, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"rlship run {run_id}: 3 steps shipped" in done.stdout
    for rank in (0, 1):
        assert f"rank {rank}: received steps [0, 1, 2]" in done.stdout
    samples = [json.loads(line) for path in (tmp_path / "samples").glob("*.jsonl") for line in path.open()]
    assert samples and all(s["rollout_id"].count("/") == 2 for s in samples), "episode/trace/branch ids"
    # prime-rl 559b447's per-agent names, under the traces' agent (the synthetic solver)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("train/agg/effective/solver/reward/mean" in r for r in records), sorted(records[0])[:40]
    assert not any(key.startswith("train/agg/effective/agent/") for r in records for key in r)


def test_bench_episodes_measures_both_ways_and_leaves_nothing(client, redis_url, tmp_path):
    """`rlship bench episodes` (BENCHMARKS.md): both producers' CPU over the same tokens, in
    throwaway runs it deletes again."""
    before = set(client.scan_iter(match="rlship:bench-episodes-*"))
    done = rlship("bench", "episodes", "--branches", "40", "--rounds", "1", "--redis-url", redis_url,
                  "--json", str(tmp_path / "bench.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "episodes / plain: " in done.stdout
    [round_] = json.loads((tmp_path / "bench.json").read_text())["rounds"]
    assert round_["rollouts"] > 0 and round_["tokens"] > 0 and round_["episodes_cpu"] > 0
    assert set(round_["full_collections"]) == {"episodes", "rollouts"}, "what each side collected"
    assert "full collections inside the timed parts: episodes " in done.stdout
    assert set(client.scan_iter(match="rlship:bench-episodes-*")) <= before
