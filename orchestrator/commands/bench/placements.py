"""The three placements of the ship path that `rlship bench loop` compares, run one per process.

- `inline`: every stage called on the orchestrator's event loop (where the seed started);
- `thread`: every stage through `asyncio.to_thread` (the seed's design);
- `celery`: the real `Orchestrator`, the stages in Celery worker processes through Redis.

All three ship the same seeded rollouts (`step_batches`) with the same stage functions to
real trainer ranks over ZMQ. The inline and thread placements hold each step's arrays in
their own memory, as the seed's orchestrator did (under `--workload moe`, the rollouts the
bench made once, read from its `StepCache` with their routed experts); they are made before
the ship window, which runs from the cut to the published record. On the loop, a
`LagProbe` observes lag every 10 ms and a heartbeat (a `LagProbe` of 50 ms) ticks, both
with their timelines.

With `--inference-concurrency`, the loop also drives the orchestrator's own inference
traffic (`inference.InferenceLoad`): alone first (its baseline), then while it ships.

Each placement runs in a fresh process (`python -m orchestrator.commands.bench.placements SPEC
RESULT`) so that its peak RSS is its own; the bench command starts it.
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import redis.asyncio as aioredis

from orchestrator.accounting import Accounting, outcome_row
from orchestrator.commands.bench.inference import InferenceLoad, InferenceSpec
from orchestrator.commands.bench.moe import StepCache
from orchestrator.commands.produce import SyntheticWorkload
from orchestrator.dispatcher import Dispatcher
from orchestrator.gate import POLL_SECONDS
from orchestrator.groups import TRAINABLE, Outcome, decide_group
from orchestrator.lag_probe import LagProbe
from orchestrator.orchestrator import Orchestrator
from orchestrator.records import RolloutRecord
from orchestrator.settings import RunSettings
from tasks.cohort import CohortBuilder
from tasks.manifest import StepManifest
from tasks.stages.encode import encode_rank, rank_segments
from tasks.stages.finalize import finalize_step
from tasks.stages.metrics import step_metrics
from tasks.stages.pack import pack_samples
from tasks.stages.prune import prune_samples, worker_drops
from tasks.stages.publish import build_record, running_totals
from tasks.stages.release import trim_process_memory
from transport.checksum import payload_checksum
from transport.connection import connect_redis_async
from transport.keys import RunKeys
from transport.numbering import required_version
from transport.payload_segments import PAYLOAD_FIELD, digests_checksum
from transport.schema import WireProfile
from transport.zmq_sender import ZMQSender

PLACEMENTS: tuple[str, ...] = (
    "inline", "thread", "celery", "celery-replicated", "celery-traced", "celery-curve"
)  # fmt: skip
DEFAULT_PLACEMENTS: tuple[str, ...] = ("inline", "thread", "celery")
# celery-replicated: the celery placement on a primary, a replica and three Sentinels of its
# own, every write the run depends on waiting for the replica (redis_wait_replicas=1).
# celery-traced: the celery placement with tracing on in every process (OTEL_EXPORTER_OTLP_ENDPOINT
# at a local receiver that discards: `orchestrator.commands.bench.otlp_sink`).
# celery-curve: the celery placement with `--zmq-curve` (keys made in its log directory).
HEARTBEAT_SECONDS = 0.05
READY_TIMEOUT_SECONDS = 120.0
SEND_TIMEOUT_SECONDS = 30.0

Rollout = tuple[RolloutRecord, dict[str, np.ndarray]]


@dataclass
class StepBatch:
    """One step's rollouts in production order, and their fates (all trainable)."""

    step: int
    rollouts: list[Rollout]
    outcomes: list[Outcome]

    @property
    def arrays(self) -> dict[str, dict[str, np.ndarray]]:
        return {record.rollout_id: arrays for record, arrays in self.rollouts}


def step_batches(settings: RunSettings, steps: int, moe: bool = False) -> Iterator[StepBatch]:
    """The seeded workload cut into steps of `batch_size` rollouts, lazily; with `moe`, each
    rollout with routed experts inline (`SyntheticWorkload(moe_inline=True)`).

    Only groups whose every rollout can train are kept, and a step holds whole groups: the
    orchestrator then cuts exactly these rollouts, in this order, at every step, so every
    placement ships the same cohort. Step `k`'s rollouts carry policy version `k`.
    """
    if not isinstance(settings.group_size, int) or settings.batch_size % settings.group_size:
        raise ValueError(
            f"rollouts: {settings.batch_size} is not a multiple of group_size {settings.group_size} "
            "(the bench takes one size for every env)"
        )
    workload = SyntheticWorkload(
        seed=settings.seed,
        group_size=settings.group_size,
        seq_len=settings.seq_len,
        vocab_size=settings.vocab_size,
        moe_inline=moe,
    )
    for step in range(steps):
        workload.policy_version = step
        rollouts: list[Rollout] = []
        outcomes: list[Outcome] = []
        while len(rollouts) < settings.batch_size:
            group = workload.group()
            fates = decide_group(
                [record for record, _ in group],
                step,
                settings.max_off_policy_steps,
                settings.normalize_advantages,
            )
            if all(o.fate == TRAINABLE for o in fates):
                rollouts.extend(group)
                outcomes.extend(fates)
        yield StepBatch(step, rollouts, outcomes)


def cut_manifest(
    settings: RunSettings,
    step: int,
    outcomes: list[Outcome],
    counters: dict[str, float] | None = None,
    loop_lag_ms: np.ndarray | None = None,
) -> StepManifest:
    """The manifest `Orchestrator.cut` writes for these outcomes (same rows, same order)."""
    rows = CohortBuilder()
    for outcome in outcomes:
        rows.append(*outcome_row(outcome))
    cohort = rows.build()
    return StepManifest(
        run_id=settings.run_id,
        step=step,
        prev_step=step - 1,
        cut_time=time.time(),
        config=settings.ship_config(),
        effective=cohort,
        window=cohort,
        counters=counters or {},
        loop_lag_ms=np.zeros(0) if loop_lag_ms is None else loop_lag_ms,
    )


def pack_step(manifest: StepManifest, arrays: dict[str, dict[str, np.ndarray]]) -> tuple[Any, Any]:
    """The step's samples (finalized, pruned) and their packing over the ranks, by the stage
    functions in a plain call (the reference's)."""
    samples, _ = prune_samples(finalize_step(manifest, arrays).samples)
    config = manifest.config
    plan = pack_samples(samples.numeric["num_tokens"], config.ranks, config.seq_len, config.pad_to_multiple)
    return samples, plan


def rank_checksums(
    samples: Any, plan: Any, arrays: dict[str, dict[str, Any]], wire: WireProfile
) -> tuple[list[str], list[str | None], int]:
    """Each rank's payload checksum (the reference every placement's ranks must receive),
    the checksum of the side-array rows it points at (None without segments: as encode
    records it), and the payloads' bytes; one payload at a time."""
    checksums: list[str] = []
    rows: list[str | None] = []
    wire_bytes = 0
    segments_of = {rid: a.get(PAYLOAD_FIELD, []) for rid, a in arrays.items()}
    for plans in plan.ranks:
        payload = encode_rank(plans, samples, arrays, wire)
        checksums.append(payload_checksum(payload))
        wire_bytes += memoryview(payload).nbytes
        del payload
        segments = rank_segments(plans, samples, segments_of)
        signed = segments and all(segment.digest for segment in segments)
        rows.append(digests_checksum(s.digest for s in segments) if signed else None)
    return checksums, rows, wire_bytes


# -- inline and thread ---------------------------------------------------------------------

Runner = Callable[..., Awaitable[Any]]


async def on_loop(function: Callable[..., Any], *args: Any) -> Any:
    """The inline placement: the stage runs on the event loop, which waits for it."""
    return function(*args)


async def in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """The thread placement: the stage runs in the default executor (the GIL is shared)."""
    return await asyncio.to_thread(function, *args)


RUNNERS: dict[str, Runner] = {"inline": on_loop, "thread": in_thread}


class InProcessShipper:
    """The seed's orchestrator: the step's arrays in its memory, every stage placed by `run`.

    It keeps the orchestrator's contract around the stages: the policy gate before the cut
    (max_async_level of the settings), one record per step on the run's metrics stream,
    release (malloc_trim) after publish.
    """

    def __init__(
        self,
        settings: RunSettings,
        client: aioredis.Redis,
        run: Runner,
        probe: LagProbe,
        batches: Callable[[int], Iterator[StepBatch]] | None = None,
    ) -> None:
        self.settings = settings
        self.batches = batches or (lambda steps: step_batches(settings, steps))
        self.client = client
        self.run = run
        self.probe = probe
        self.keys = RunKeys(settings.run_id)
        self.accounting = Accounting()
        self.totals: dict[str, float] = {}
        self.windows: dict[int, list[float]] = {}
        self.arrivals: dict[int, float] = {}
        self.sender: ZMQSender | None = None

    async def wait_for_policy(self, step: int) -> float:
        """The orchestrator's gate: the trainers' policy version >= the step's required one."""
        needed = required_version(step, self.settings.first_step, self.settings.max_async_level)
        started = time.perf_counter()
        while int(await self.client.get(self.keys.policy_version) or 0) < needed:
            await asyncio.sleep(POLL_SECONDS)
        return time.perf_counter() - started

    def connect(self) -> ZMQSender:
        """The sender to the trainer ranks, once every rank is ready (made once)."""
        if self.sender is None:
            sender = ZMQSender(
                self.settings.zmq_host,
                self.settings.zmq_port,
                self.settings.ranks,
                run_id=self.settings.run_id,
                send_timeout=SEND_TIMEOUT_SECONDS,
            )
            if not sender.wait_ready(READY_TIMEOUT_SECONDS):
                sender.close()
                raise RuntimeError(f"trainer ranks not ready within {READY_TIMEOUT_SECONDS:.0f} s")
            self.sender = sender
        return self.sender

    async def ship(self, steps: int) -> None:
        try:
            sender = self.connect()
            for batch in self.batches(steps):
                waited = await self.wait_for_policy(batch.step)
                # Held in memory, the step's rollouts arrive (the last one completes the
                # batch) when the gate opens: the bench's trainers are waiting for them.
                self.arrivals[batch.step] = asyncio.get_running_loop().time()
                await self.ship_step(batch, sender, waited)
                del batch
                await self.run(trim_process_memory)
        finally:
            if self.sender is not None:
                self.sender.close()

    async def ship_step(self, batch: StepBatch, sender: ZMQSender, waited: float) -> None:
        """Cut, finalize, prune, metrics, pack, encode and send per rank, publish: the window."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        step, arrays, config = batch.step, batch.arrays, self.settings.ship_config()
        self.accounting.arrived += len(batch.outcomes)
        self.accounting.cut += len(batch.outcomes)
        manifest = cut_manifest(
            self.settings, step, batch.outcomes, self.accounting.snapshot(0, 0), self.probe.take_window()
        )
        seconds: dict[str, float] = {}

        async def stage(name: str, function: Callable[..., Any], *args: Any) -> Any:
            stage_started = time.perf_counter()
            result = await self.run(function, *args)
            seconds[name] = max(seconds.get(name, 0.0), time.perf_counter() - stage_started)
            return result

        finalized = await stage("finalize", finalize_step, manifest, arrays)
        samples, pruned = await stage("prune", prune_samples, finalized.samples)
        dropped = list(worker_drops(finalized.failures, pruned).values())
        metrics = await stage("metrics", step_metrics, manifest, samples, dropped)
        plan = await stage(
            "pack",
            pack_samples,
            samples.numeric["num_tokens"],
            config.ranks,
            config.seq_len,
            config.pad_to_multiple,
        )
        for rank, plans in enumerate(plan.ranks):
            payload = await stage("encode", encode_rank, plans, samples, arrays, config.wire_profile)
            await stage("send", sender.send, step, rank, payload)
        self.totals = running_totals(self.totals, metrics)
        ship_seconds = time.time() - manifest.cut_time
        record = build_record(
            step, metrics, seconds, ship_seconds, waited, self.totals, names=config.record_names
        )
        await self.client.xadd(self.keys.metrics_stream, {"step": step, "record": json.dumps(record)})
        self.windows[step] = [started, loop.time()]


# -- celery --------------------------------------------------------------------------------


class TimedOrchestrator(Orchestrator):
    """The real orchestrator, noting on its loop when each step is cut and when its record
    is seen, with a lag probe that keeps its timeline."""

    def __init__(self, settings: RunSettings, client: aioredis.Redis) -> None:
        super().__init__(settings, client, probe=LagProbe(keep_timeline=True))
        self.windows: dict[int, list[float]] = {}
        self.arrivals: dict[int, float] = {}  # none: its rollouts come from the bench's feed
        self.dispatcher.cut = self._timed_cut  # type: ignore[method-assign]

    async def _timed_cut(self, step: int, policy_wait: float = 0.0) -> StepManifest | None:
        started = asyncio.get_running_loop().time()
        manifest = await Dispatcher.cut(self.dispatcher, step, policy_wait)
        if manifest is not None:
            self.windows[step] = [started, started]
        return manifest

    async def step_published(self, step: int) -> None:
        self.windows[step][1] = asyncio.get_running_loop().time()
        await super().step_published(step)


# -- one placement, in this process ----------------------------------------------------------


def _timeline(probe: LagProbe, origin: float) -> dict[str, list[float]]:
    assert probe.times is not None
    return {
        "t": [round(t - origin, 4) for t in probe.times],
        "ms": [round(lag, 3) for lag in probe.lags_ms],
    }


async def run_placement(
    placement: str,
    settings: RunSettings,
    timeout: float,
    batches: Callable[[int], Iterator[StepBatch]] | None = None,
    inference: InferenceSpec | None = None,
    shipping_flag: Path | None = None,
) -> dict[str, Any]:
    """Ship `settings.steps` steps in `placement` (the in-process ones: `batches`, by default
    the seeded workload); the windows and timelines on this loop's clock. With `inference`,
    the loop's own inference load runs first alone (its baseline), then while it ships;
    `shipping_flag` is made when the shipping begins (the bench's feed waits for it)."""
    loop = asyncio.get_running_loop()
    origin = loop.time()
    baseline_rss = psutil.Process().memory_info().rss
    heartbeat = LagProbe(HEARTBEAT_SECONDS, keep_timeline=True)
    client = connect_redis_async(settings.redis_url, socket_timeout=60)
    background = [asyncio.create_task(heartbeat.run())]
    load = InferenceLoad(inference, origin) if inference is not None else None
    try:
        if not placement.startswith("celery"):
            probe = LagProbe(keep_timeline=True)
            background.append(asyncio.create_task(probe.run()))
            in_process = InProcessShipper(settings, client, RUNNERS[placement], probe, batches)
            in_process.connect()  # the trainer ranks up and idle before the load's baseline, as celery's are
        if load is not None:
            load.start()
            await load.measure_baseline()
        if shipping_flag is not None:
            shipping_flag.touch()
        if placement.startswith("celery"):
            shipper: TimedOrchestrator | InProcessShipper = TimedOrchestrator(settings, client)
            shipping = shipper.run()
        else:
            shipper = in_process
            shipping = shipper.ship(settings.steps)
        shipped = asyncio.wait_for(shipping, timeout)
        await (load.while_running(shipped) if load is not None else shipped)
    finally:
        if load is not None:
            await load.stop()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await client.aclose()
    return {
        "placement": placement,
        "origin": origin,  # the loop's clock is the monotonic clock: the bench's CPU sampler reads it too
        "windows": {
            str(step): [start - origin, end - origin] for step, (start, end) in shipper.windows.items()
        },
        "arrivals": {str(step): at - origin for step, at in shipper.arrivals.items()},
        "lag": _timeline(shipper.probe, origin),
        "heartbeat": _timeline(heartbeat, origin),
        "baseline_rss_bytes": baseline_rss,
        "peak_rss_bytes": peak_rss_bytes(),
        **({"inference": load.result()} if load is not None else {}),
    }


def peak_rss_bytes() -> int:
    """This process's peak RSS since it started (VmHWM). Not `ru_maxrss`: Linux carries that
    over from the parent across fork and exec, so a child would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def main(argv: list[str]) -> int:
    """`python -m orchestrator.commands.bench.placements SPEC RESULT`: SPEC holds the placement,
    the settings and the timeout, under `--workload moe` the bench's step cache and whether
    the routed experts are shipped (in this process's memory), and with
    `--inference-concurrency` the inference load's spec and the file that says shipping began."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the bench asks for stacks on timeout
    spec = json.loads(Path(argv[0]).read_text())
    settings = RunSettings(**spec["settings"])
    batches = None
    if spec.get("steps_cache"):
        cache = StepCache(Path(spec["steps_cache"]))
        batches = functools.partial(cache.batches, experts=bool(spec["routed_experts"]), in_memory=True)
    inference = InferenceSpec(**spec["inference"]) if spec.get("inference") else None
    flag = Path(spec["shipping_flag"]) if spec.get("shipping_flag") else None
    result = asyncio.run(
        run_placement(spec["placement"], settings, spec["timeout"], batches, inference, flag)
    )
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
