"""One placement of `rlship bench loop` in its own processes: the trainer ranks, the
Celery workers (celery placement), the placement's process
(`orchestrator.commands.bench.placements`) at the CPU priority asked for, and the
producer that feeds the celery placement; CPU sampled by process kind and the moment
each step was decoded by its last rank heard meanwhile. Under `--workload moe` also
Redis's used memory and the bytes under the run's payload directories
(`orchestrator.commands.bench.memory`), on a Redis server of the placement's own unless
`--redis-server shared`."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import redis

from orchestrator.commands.bench.cpu import CpuSampler
from orchestrator.commands.bench.inference import InferenceSpec
from orchestrator.commands.bench.memory import DirectoryBytes, MemoryLimitReached, MemoryWatch, RedisMemory
from orchestrator.commands.bench.mock_inference import start_mock_inference
from orchestrator.commands.bench.moe import Rollout, StepCache, Variant, routed_experts_as
from orchestrator.commands.bench.otlp_sink import OtlpSink
from orchestrator.commands.bench.placements import StepBatch
from orchestrator.commands.processes import (
    ProcessGroup,
    delete_run_keys,
    rlship_command,
    wait_for_workers,
    worker_commands,
)
from orchestrator.commands.run_report import received_by_rank
from orchestrator.commands.sentinel_cluster import LocalSentinelCluster, start_redis_server
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings, settings_to_env
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.numbering import step_reaching, version_after
from transport.zmq_curve import make_keys
from transport.zmq_sockets import free_port_pair

TRAINER_IDLE_SECONDS = 300
TRAINER_DRAIN_SECONDS = 120.0
# Rollouts per producer call of the celery placement's feed: a step arrives in many calls,
# as inference returns groups, and the orchestrator ingests them while more come.
FEED_CALL_ROLLOUTS = 128


def fill_seconds(args: argparse.Namespace) -> float:
    """How long a step's rollouts take to arrive: `--fill-seconds`, by default half a
    millisecond a rollout (inference is the slower side: the trainer waits for the batch)."""
    return args.fill_seconds if args.fill_seconds is not None else 0.0005 * args.rollouts


class StepsDecoded:
    """When each step was decoded by its last rank: the trainer rank completing a step raises
    the policy version and publishes it on the run's channel (transport.trainer), heard here
    on the monotonic clock every process of this machine shares."""

    def __init__(self, client: redis.Redis, settings: RunSettings) -> None:
        self.first_step = settings.first_step
        self.at: dict[int, float] = {}
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(RunKeys(settings.run_id).policy_channel)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stopped.is_set():
            message = self._pubsub.get_message(timeout=0.1)
            if message is not None:
                heard = time.monotonic()
                self.at.setdefault(step_reaching(int(message["data"]), self.first_step), heard)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5)
        self._pubsub.close()


def _prioritized(
    command: list[str], niceness: int, idle_class: bool = False, fifo: bool = False
) -> list[str]:
    """`command` at this CPU priority (chrt and nice exec it: the PID stays the command's).
    SCHED_IDLE runs only when nothing else wants the CPU; SCHED_FIFO preempts every normal
    process as soon as it wakes."""
    policy = ["chrt", "--idle", "0"] if idle_class else ["chrt", "--fifo", "10"] if fifo else []
    return [*policy, *(["nice", "-n", str(niceness)] if niceness else []), *command]


@dataclass
class StepSource:
    """Where a placement's producer takes each step's rollouts from: `batch(step)` (a step
    read when the producer comes to it, after the one before it was shipped), and, under
    `--workload moe`, the step cache the in-process placements read themselves."""

    steps: int
    batch: Callable[[int], StepBatch]
    cache: StepCache | None = None

    @classmethod
    def of_list(cls, batches: list[StepBatch]) -> StepSource:
        return cls(len(batches), batches.__getitem__)

    @classmethod
    def of_cache(cls, cache: StepCache, steps: int, routed_experts: bool) -> StepSource:
        return cls(steps, lambda step: cache.read(step, routed_experts), cache)


def server_options(args: argparse.Namespace) -> list[str]:
    """The mock inference server's pace and workload, from the bench's options."""
    return [
        *("--ttft-ms", str(args.inference_ttft_ms), "--token-ms", str(args.inference_token_ms)),
        *("--chunk-tokens", str(args.inference_chunk_tokens)),
        *("--seq-len", str(args.seq_len), "--seed", str(args.seed)),
    ]


def inference_spec(args: argparse.Namespace, settings: RunSettings, url: str) -> InferenceSpec:
    """The orchestrator's inference load: `--inference-concurrency` requests in flight to `url`,
    one step's rollouts kept."""
    return InferenceSpec(
        url=url,
        concurrency=args.inference_concurrency,
        warmup_seconds=args.inference_warmup_seconds,
        baseline_seconds=args.inference_baseline_seconds,
        seq_len=settings.seq_len,
        vocab_size=settings.vocab_size,
        group_size=settings.group_size,
        rollouts_kept=settings.batch_size,
    )


def placement_settings(
    name: str, variant: Variant, base: RunSettings, log_root: Path, payload_root: Path
) -> RunSettings:
    """The run settings of a placement's run: its own run id, queues and log directory, the
    variant's settings, side arrays by handle under `payload_root`."""
    token = secrets.token_hex(3)
    return base.with_changes(
        run_id=f"bench-loop-{name}-{token}",
        cpu_queue=f"bench-cpu-{token}",
        ship_queue=f"bench-ship-{token}",
        output_dir=(log_root / name).resolve(),
        payload_root=payload_root.resolve(),
        **variant.settings,
    )


def run_placement(
    variant: Variant, settings: RunSettings, source: StepSource, args: argparse.Namespace
) -> dict[str, Any]:
    """Ship every step in the variant's placement; return its process's result, what each
    rank received, the published records and (`--workload moe`) the memory figures."""
    placement, log_dir = variant.placement, Path(settings.output_dir)
    cluster = server = None
    if placement == "celery-replicated":
        cluster = LocalSentinelCluster(log_dir / "redis").start()
        settings = settings.model_copy(update={"redis_url": cluster.url, "redis_wait_replicas": 1})
    elif args.redis_server == "own":
        port = free_port_pair()
        server = start_redis_server(log_dir / "redis", port)
        settings = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{port}/0"})
    if placement == "celery-curve":  # the run's key pairs, as `rlship run --zmq-curve` makes them
        make_keys(log_dir / "keys", settings.ranks)
        settings = settings.model_copy(update={"zmq_curve": True, "zmq_keys_dir": log_dir / "keys"})
    # Chosen once the servers listen: a pair is free only until someone binds it.
    settings = settings.model_copy(update={"zmq_port": free_port_pair()})
    try:
        return _run_placement(variant, settings, source, args, server)
    finally:
        if cluster is not None:
            cluster.stop()
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def watched_directories(settings: RunSettings) -> dict[str, Path]:
    """The run's directories whose bytes the bench follows: its rows files under the payload
    root, and with `payload_store` dir its retained per-rank payloads."""
    directories = {"payload_root": settings.run_rows().directory}
    payloads = settings.payload_directory()
    if payloads is not None:
        directories["payload_dir"] = Path(payloads.root)
    return directories


def _run_placement(
    variant: Variant,
    settings: RunSettings,
    source: StepSource,
    args: argparse.Namespace,
    server: subprocess.Popen | None,
) -> dict[str, Any]:
    placement, log_dir = variant.placement, Path(settings.output_dir)
    group = ProcessGroup(env=settings_to_env(settings), log_dir=log_dir)
    sink = OtlpSink() if placement == "celery-traced" else None
    if sink is not None:  # every process of the placement traces, as `rlship run`'s would
        group.env = {**group.env, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
    spec, result = log_dir / "spec.json", log_dir / "result.json"
    deadline = time.monotonic() + args.timeout
    client = connect_redis(settings.redis_url)
    memory = directories = watch = None
    if args.workload == "moe":  # from before the first process starts: its baseline is the run's
        memory = RedisMemory(settings.redis_url, server is not None).start()
        directories = DirectoryBytes(watched_directories(settings)).start()

        def victims() -> list[subprocess.Popen]:
            return [*group.processes.values(), *([server] if server is not None else [])]

        if args.min_available_mib:
            watch = MemoryWatch(args.min_available_mib * 2**20, victims).start()
    decoded = StepsDecoded(client, settings)  # until the trainer ranks are done
    memory_figures: dict[str, Any] = {}
    try:
        for rank in range(settings.ranks):
            trainer = rlship_command(
                "trainer", "--rank", str(rank), "--idle-timeout", str(TRAINER_IDLE_SECONDS)
            )
            group.start(f"trainer-{rank}", _prioritized(trainer, args.trainer_nice, args.idle_class))
        if placement.startswith("celery"):
            for name, command in worker_commands(settings).items():
                group.start(name, _prioritized(command, args.worker_nice, args.idle_class))
            wait_for_workers(settings, group)
        inference, shipping_flag = None, None
        if args.inference_concurrency:
            inference = inference_spec(
                args, settings, start_mock_inference(group, server_options(args), log_dir / "inference.port")
            )
            shipping_flag = log_dir / "shipping"
            shipping_flag.unlink(missing_ok=True)
        spec.write_text(
            json.dumps(
                {
                    "placement": placement,
                    "settings": settings.model_dump(mode="json"),
                    "timeout": args.timeout,
                    "steps_cache": str(source.cache.root) if source.cache is not None else None,
                    "routed_experts": variant.routed_experts == "inline",
                    "inference": inference.to_json() if inference is not None else None,
                    "shipping_flag": str(shipping_flag) if shipping_flag is not None else None,
                }
            )
        )
        result.unlink(missing_ok=True)
        child = group.start(
            "orchestrator",
            _prioritized(
                [sys.executable, "-m", "orchestrator.commands.bench.placements", str(spec), str(result)],
                args.orchestrator_nice,
                fifo=args.orchestrator_fifo,
            ),
        )
        sampler = CpuSampler(process_kinds(group, client))
        sampler.start()
        arrivals = {}
        if placement.startswith("celery"):
            handed = routed_experts_as(variant.routed_experts, settings.run_rows())
            arrivals = feed(settings, source, handed, group, deadline, fill_seconds(args), shipping_flag)
        try:
            child.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR1)  # its threads' stacks, into its log
            time.sleep(1.0)
            raise RuntimeError(f"{placement}: not done within {args.timeout:.0f} s; see {log_dir}") from None
        finally:
            sampler.stop()
            memory_figures = _stop_memory(memory, directories)
        if child.returncode != 0 or not result.exists():
            raise RuntimeError(
                f"{placement}: the orchestrator process exited with {child.returncode}; see {log_dir}"
            )
        drained = time.monotonic() + TRAINER_DRAIN_SECONDS
        for rank in range(settings.ranks):  # a rank that missed a step shows in `received`
            with contextlib.suppress(subprocess.TimeoutExpired):
                group.processes[f"trainer-{rank}"].wait(max(0.1, drained - time.monotonic()))
        received = received_by_rank(client, settings.run_id, settings.ranks)
        stream = client.xrange(RunKeys(settings.run_id).metrics_stream)
        records = [json.loads(fields[b"record"]) for _, fields in stream]
    except Exception as exc:
        if watch is not None and watch.tripped:
            raise MemoryLimitReached(f"{placement}: {watch.tripped}; see {log_dir}") from exc
        raise
    finally:
        if watch is not None:
            watch.stop()
        if memory is not None and not memory_figures:
            _stop_memory(memory, directories)
        decoded.stop()
        group.stop_all()
        otlp = sink.stop() if sink is not None else None
        if server is None:  # a server of the placement's own goes with everything in it
            delete_run_keys(settings)
        settings.run_rows().remove_all()  # what a failed run left (a finished one removed its own)
        payloads = settings.payload_directory()
        if payloads is not None:
            payloads.remove_all()
    raw = json.loads(result.read_text())
    origin = raw["origin"]
    windows = {step: (start + origin, end + origin) for step, (start, end) in raw["windows"].items()}
    cpu = dict(zip(windows, sampler.in_windows(list(windows.values())), strict=True))
    # A step's cycle, from its cut to the next one's: every process's work for one step in
    # steady state (the next step's prepare, this one's release), whatever a window holds.
    order = sorted(windows, key=int)
    cycles = [(windows[step][0], windows[after][0]) for step, after in itertools.pairwise(order)]
    cpu_cycles = dict(zip(order, sampler.in_windows(cycles), strict=False))
    # The in-process placements note their steps' arrivals themselves (on their loop's clock).
    arrivals = arrivals or {int(step): at + origin for step, at in raw["arrivals"].items()}
    idle = {str(step): decoded.at[step] - arrived for step, arrived in arrivals.items() if step in decoded.at}
    return {
        **raw,
        "received": received,
        "records": records,
        "cpu": cpu,
        "cpu_cycles": cpu_cycles,
        "idle_seconds": idle,
        **memory_figures,
        **({"otlp_received": otlp} if otlp is not None else {}),
    }


def _stop_memory(memory: RedisMemory | None, directories: DirectoryBytes | None) -> dict[str, Any]:
    """The memory figures of the run (`--workload moe`), the samplers stopped; the timelines
    of Redis's used memory and of the payload directories' bytes on the monotonic clock."""
    if memory is None or directories is None:
        return {}
    figures = {"redis_memory": memory.stop(), "directories": directories.stop()}
    figures["redis_memory"]["timeline"] = memory.timeline(0.0)
    figures["directories"]["timeline"] = directories.timeline(0.0)
    return figures


def process_kinds(group: ProcessGroup, client: redis.Redis) -> dict[str, list[int]]:
    """The PIDs whose process trees make each kind's CPU: the Celery workers (their pool
    children are in their trees), the orchestrator process, the trainer ranks and, when it
    runs on this machine, the Redis server."""
    kinds: dict[str, list[int]] = {"orchestrator": [], "workers": [], "trainers": [], "redis": []}
    for name, process in group.processes.items():
        kind = "trainers" if name.startswith("trainer-") else "workers" if name.endswith("-worker") else name
        kinds.setdefault(kind, []).append(process.pid)
    redis_pid = int(client.info("server")["process_id"])
    with contextlib.suppress(psutil.Error):
        if "redis" in psutil.Process(redis_pid).name():
            kinds["redis"].append(redis_pid)
    return kinds


def feed(
    settings: RunSettings,
    source: StepSource,
    handed: Callable[[list[Rollout]], list[Rollout]],
    group: ProcessGroup,
    deadline: float,
    fill_seconds: float,
    shipping_flag: Path | None = None,
) -> dict[int, float]:
    """The producer of the celery placement. Step k's rollouts come once the trainer ranks
    have decoded step k - 1 and its record is published (the trainers wait for them, the
    gate is open: what follows is the ship path's alone), in calls of FEED_CALL_ROLLOUTS
    spread over `fill_seconds`, as inference returns them, each call's rollouts as
    `handed` makes them (routed experts written to rows files, for one); returns when each
    step's last call returned (its last rollout arrived), on the monotonic clock. The step
    is read only then, and let go before its cut: no step is held while one ships. With a
    `shipping_flag`, nothing comes before the orchestrator process makes it (its inference
    load's baseline is the load alone)."""
    client = connect_redis(settings.redis_url)
    producer = RolloutProducer.for_run(client, settings, admitted=False)
    keys = RunKeys(settings.run_id)
    arrivals: dict[int, float] = {}
    while shipping_flag is not None and not shipping_flag.exists():
        if group.failed() or time.monotonic() > deadline:
            return arrivals
        time.sleep(0.01)
    for step in range(source.steps):
        previous = version_after(step - 1, settings.first_step)
        while step and not (
            client.hexists(keys.published, step - 1) and int(client.get(keys.policy_version) or 0) >= previous
        ):
            if group.failed() or time.monotonic() > deadline:
                return arrivals
            time.sleep(0.005)
        rollouts = source.batch(step).rollouts
        starts = range(0, len(rollouts), FEED_CALL_ROLLOUTS)
        began = time.monotonic()
        for call, start in enumerate(starts):
            time.sleep(max(0.0, began + fill_seconds * call / len(starts) - time.monotonic()))
            producer.produce(handed(rollouts[start : start + FEED_CALL_ROLLOUTS]))
        arrivals[step] = time.monotonic()
        del rollouts
    return arrivals
