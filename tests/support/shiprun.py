"""Run steps through the real ship path from a test: rollouts produced up front, trainer
ranks as subprocesses, the orchestrator on this process's event loop, the session's
Celery workers doing the stages."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from orchestrator.commands.produce import run_producer
from orchestrator.orchestrator import Orchestrator
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings, settings_to_env
from tests.support.factories import group
from tests.support.processes import REPO, Workers, python_command
from tests.support.stock_peers import start_stock_ranks
from transport.connection import connect_redis, connect_redis_async
from transport.keys import RunKeys
from transport.numbering import version_after
from transport.store import PayloadStore
from transport.zmq_sockets import free_port_pair


def ship_settings(
    run_id: str, redis_url: str, workers: Workers, output_dir: Path, **overrides: Any
) -> RunSettings:
    values: dict[str, Any] = {
        "run_id": run_id,
        "redis_url": redis_url,
        "steps": 3,
        "ranks": 2,
        "batch_size": 16,
        "group_size": 4,
        "seq_len": 512,
        "zmq_port": free_port_pair(),
        "output_dir": output_dir,
        "cpu_queue": workers.cpu_queue,
        "ship_queue": workers.ship_queue,
    }
    values.update(overrides)
    return RunSettings(**values)


def open_policy_gate(settings: RunSettings) -> None:
    """Announce, as a prime-rl trainer does (`{broadcast_dir}/step_{n}/STABLE`), a policy
    version no step of the run waits beyond: for tests whose external trainers announce
    nothing (no one reads, or the test reads the files afterwards) and that do not test
    the gate."""
    last = settings.step_numbers[-1]
    stable = Path(settings.broadcast_dir) / f"step_{version_after(last, settings.first_step)}" / "STABLE"
    stable.parent.mkdir(parents=True, exist_ok=True)
    stable.touch()


def start_trainers(settings: RunSettings, ranks: list[int] | None = None) -> list[subprocess.Popen]:
    """Trainer rank processes (all ranks, or the ones named)."""
    env = {**os.environ, **settings_to_env(settings), "PYTHONPATH": str(REPO)}
    log_dir = Path(settings.output_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            python_command("trainer", "--rank", str(rank), "--idle-timeout", "60"),
            env=env,
            cwd=REPO,
            stdout=open(log_dir / f"trainer-{rank}.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        for rank in (range(settings.ranks) if ranks is None else ranks)
    ]


def stop(processes: list[subprocess.Popen], timeout: float = 60.0) -> None:
    for process in processes:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class ShipResult:
    summary: dict[str, Any]
    records: list[dict[str, float]]
    orchestrator: Orchestrator


async def run_orchestrator(settings: RunSettings, timeout: float = 120.0) -> ShipResult:
    client = connect_redis_async(settings.redis_url, socket_timeout=30)
    try:
        orchestrator = Orchestrator(settings, client)
        summary = await asyncio.wait_for(orchestrator.run(), timeout)
        return ShipResult(summary, list(orchestrator.follower.records), orchestrator)
    finally:
        await client.aclose()


def ship(settings: RunSettings, trainers: bool = True, produce: bool = True) -> ShipResult:
    """Ship `settings.steps` steps end to end while a producer thread keeps rollouts coming
    (unless `produce` is False: the caller wrote the rollouts beforehand)."""
    ranks = start_trainers(settings) if trainers else []
    stop_producing = threading.Event()
    producer = threading.Thread(target=run_producer, args=(settings,), kwargs={"stop": stop_producing})
    if produce:
        producer.start()
    try:
        result = asyncio.run(run_orchestrator(settings))
    finally:
        stop_producing.set()
        if produce:
            producer.join()
        stop(ranks)
    # As `rlship run` does once the producer has stopped: what it wrote late never ships.
    PayloadStore(connect_redis(settings.redis_url), settings.run_id).delete_all_rollouts()
    return result


def ship_to_stock_ranks(settings: RunSettings, steps: Sequence[int]) -> list[Path]:
    """Ship the run, its rollouts written beforehand, to stock ranks that exit after their
    `steps[rank]` steps (`start_stock_ranks`); the records of what each got."""
    records, peers = start_stock_ranks(settings, steps)
    try:
        ship(settings, trainers=False, produce=False)
        assert [peer.wait(60) for peer in peers] == [0] * settings.ranks
    finally:
        for peer in peers:
            peer.kill()
    return records


def metrics_lines(settings: RunSettings) -> list[dict[str, float]]:
    path = Path(settings.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def deterministic_run(
    client: redis.Redis, run_id: str, redis_url: str, workers: Workers, output_dir: Path, steps: int
) -> RunSettings:
    """Rollouts written up front, all trainable and on-policy: every step's cohort, and so
    every payload, is the same in every run."""
    settings = ship_settings(
        run_id,
        redis_url,
        workers,
        output_dir,
        steps=steps,
        batch_size=8,
        group_size=4,
        max_off_policy_steps=100,
    )
    producer = RolloutProducer(client, run_id)
    for index in range(steps * 2 + 2):
        producer.produce(group(f"d{index}", [1.0, 0.0, 1.0, 0.0], num_output_tokens=10 + index, env="math"))
    return settings


def delivered(
    client: redis.Redis, run_id: str, ranks: int
) -> tuple[dict[int, dict[int, str]], dict[int, dict[int, int]]]:
    """What each rank acknowledged (step -> checksum) and how often each step reached it."""
    keys = RunKeys(run_id)
    checksums = {
        r: {int(s): c.decode() for s, c in client.hgetall(keys.received(r)).items()} for r in range(ranks)
    }
    counts = {
        r: {int(s): int(n) for s, n in client.hgetall(keys.deliveries(r)).items()} for r in range(ranks)
    }
    return checksums, counts


def leftover_keys(client, run_id: str) -> list[str]:
    """Payload, step and retention keys of the run still in Redis."""
    return PayloadStore(client, run_id).held_keys()


def start_orchestrator(settings: RunSettings, log: Path) -> subprocess.Popen:
    env = {**os.environ, **settings_to_env(settings), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        python_command("orchestrate"), env=env, cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT
    )
