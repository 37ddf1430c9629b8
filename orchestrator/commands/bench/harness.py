"""One placement of `rlship bench loop` in its own processes: the trainer ranks, the
Celery workers (celery placement), the placement's process
(`orchestrator.commands.bench.placements`) at the CPU priority asked for, and the
producer that feeds the celery placement; CPU sampled by process kind meanwhile."""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import redis

from orchestrator.commands.bench.cpu import CpuSampler
from orchestrator.commands.bench.placements import StepBatch
from orchestrator.commands.processes import (
    ProcessGroup,
    delete_run_keys,
    rlship_command,
    wait_for_workers,
    worker_commands,
)
from orchestrator.commands.run import received_by_rank
from orchestrator.commands.sentinel_cluster import LocalSentinelCluster
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings, settings_to_env
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.zmq_sockets import free_port_pair

TRAINER_IDLE_SECONDS = 300
TRAINER_DRAIN_SECONDS = 120.0


def _prioritized(
    command: list[str], niceness: int, idle_class: bool = False, fifo: bool = False
) -> list[str]:
    """`command` at this CPU priority (chrt and nice exec it: the PID stays the command's).
    SCHED_IDLE runs only when nothing else wants the CPU; SCHED_FIFO preempts every normal
    process as soon as it wakes."""
    policy = ["chrt", "--idle", "0"] if idle_class else ["chrt", "--fifo", "10"] if fifo else []
    return [*policy, *(["nice", "-n", str(niceness)] if niceness else []), *command]


def run_placement(
    placement: str, base: RunSettings, batches: list[StepBatch], args: argparse.Namespace, log_root: Path
) -> dict[str, Any]:
    """Ship every step in `placement`; return its process's result, what each rank received and
    the published records."""
    token = secrets.token_hex(3)
    log_dir = (log_root / placement).resolve()
    settings = base.model_copy(
        update={
            "run_id": f"bench-loop-{placement}-{token}",
            "zmq_port": free_port_pair(),
            "cpu_queue": f"bench-cpu-{token}",
            "ship_queue": f"bench-ship-{token}",
            "output_dir": log_dir,
        }
    )
    cluster = None
    if placement == "celery-replicated":
        cluster = LocalSentinelCluster(log_dir / "redis").start()
        settings = settings.model_copy(update={"redis_url": cluster.url, "redis_wait_replicas": 1})
    try:
        return _run_placement(placement, settings, batches, args, log_dir)
    finally:
        if cluster is not None:
            cluster.stop()


def _run_placement(
    placement: str, settings: RunSettings, batches: list[StepBatch], args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    group = ProcessGroup(env=settings_to_env(settings), log_dir=log_dir)
    spec, result = log_dir / "spec.json", log_dir / "result.json"
    deadline = time.monotonic() + args.timeout
    client = connect_redis(settings.redis_url)
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
        spec.write_text(
            json.dumps(
                {
                    "placement": placement,
                    "settings": settings.model_dump(mode="json"),
                    "timeout": args.timeout,
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
        if placement.startswith("celery"):
            feed(settings, batches, group, deadline)
        try:
            child.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR1)  # its threads' stacks, into its log
            time.sleep(1.0)
            raise RuntimeError(f"{placement}: not done within {args.timeout:.0f} s; see {log_dir}") from None
        finally:
            sampler.stop()
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
    finally:
        group.stop_all()
        delete_run_keys(settings)
    raw = json.loads(result.read_text())
    origin = raw["origin"]
    windows = {step: (start + origin, end + origin) for step, (start, end) in raw["windows"].items()}
    cpu = dict(zip(windows, sampler.in_windows(list(windows.values())), strict=True))
    return {**raw, "received": received, "records": records, "cpu": cpu}


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


def feed(settings: RunSettings, batches: list[StepBatch], group: ProcessGroup, deadline: float) -> None:
    """The producer of the celery placement: step k's rollouts go to Redis once step k - 1 is
    published, so they are ingested before the cut, as the in-process placements hold theirs."""
    client = connect_redis(settings.redis_url)
    producer = RolloutProducer.for_run(client, settings, admitted=False)  # a step's batch in one call
    published = RunKeys(settings.run_id).published
    for batch in batches:
        while batch.step and not client.hexists(published, batch.step - 1):
            if group.failed() or time.monotonic() > deadline:
                return
            time.sleep(0.01)
        producer.produce(batch.rollouts)
