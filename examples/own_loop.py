"""An integrator's run, end to end (docs/integrators.md): your inference loop produces
rollouts into rlship, rlship's side (its Celery workers and orchestrator) turns them into
one payload per trainer rank a step, and your trainer ranks receive them, either through
rlship's prime-rl-shaped receivers or as a stock prime-rl trainer does.

From a checkout, with a Redis at REDIS_URL (default redis://127.0.0.1:6379/0):

    python examples/own_loop.py --steps 3 --receivers prime
    python examples/own_loop.py --steps 3 --receivers stock

Everything it starts it stops again by PID; it exits 0 once every rank has every step.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import zmq

from rlship import (
    AdmissionRefused,
    RolloutProducer,
    RolloutRecord,
    RunSettings,
    ZMQMicroBatchReceiver,
    connect_redis,
)
from transport.codec import decode_microbatches

# -- your inference side ---------------------------------------------------------------------


def sample_group(rng: np.random.Generator, group_id: str, size: int, version: int) -> list:
    """What your inference server makes of one prompt: `size` completions, each scored.
    Here random tokens stand in for the model; the arrays are what rlship needs of each:
    `input_ids` (prompt then completion, integers below the run's vocab_size), `loss_mask`
    (bool, True on the completion's tokens) and `inference_logprobs` (float32, the sampler's
    log-probability of each token)."""
    prompt = rng.integers(0, 32_000, size=int(rng.integers(8, 32)))
    group = []
    for index in range(size):
        completion = rng.integers(0, 32_000, size=int(rng.integers(16, 96)))
        record = RolloutRecord(
            rollout_id=f"{group_id}-{index}",
            group_id=group_id,
            task_id=f"task-{group_id}",
            env="math",
            policy_version=version,  # the weights that sampled it
            reward=float(rng.random() < 0.5),
            num_input_tokens=len(prompt),
            num_output_tokens=len(completion),
        )
        tokens = len(prompt) + len(completion)
        arrays = {
            "input_ids": np.concatenate([prompt, completion]).astype(np.int32),
            "loss_mask": np.arange(tokens) >= len(prompt),
            "inference_logprobs": -rng.random(tokens).astype(np.float32),
        }
        group.append((record, arrays))
    return group


def inference_loop(redis_url: str, run_id: str, stop: threading.Event) -> None:
    """Produce whole groups as the run admits them, each stamped with the trainers'
    current policy version, until the run has finished (or told to stop). The producer
    knows the run by its id: its settings are the ones its orchestrator stored."""
    producer = RolloutProducer.for_run(connect_redis(redis_url), run_id, wait=60)  # the run may start later
    run = producer.settings
    rng = np.random.default_rng(run.seed)
    groups = 0
    while not stop.is_set():
        group = sample_group(rng, f"g{groups}", run.group_size, producer.policy_version())
        try:
            producer.produce(group, timeout=1.0)  # waits while the run has enough buffered
        except AdmissionRefused as refused:
            if refused.reason == "finished":
                return  # every step shipped: the run takes nothing more
            if refused.passes:
                continue  # still full after the timeout: sample again later
            raise
        groups += 1


# -- your trainer side -----------------------------------------------------------------------


def announce(settings: RunSettings, version: int) -> None:
    """What prime-rl's trainer does after each step: its weights for `version`, marked
    STABLE in the broadcast directory. The orchestrator's policy gate reads it."""
    directory = Path(settings.broadcast_dir) / f"step_{version}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "STABLE").touch()


def train_with_rlship_receiver(settings: RunSettings, rank: int, got: dict[int, list[int]]) -> None:
    """prime-rl's receiver interface over rlship's: each step once, in order (duplicates
    dropped, a lost step replayed from Redis), acknowledged in the run's Redis."""
    transport = SimpleNamespace(host=settings.zmq_host, port=settings.zmq_port)
    receiver = ZMQMicroBatchReceiver(
        settings.output_dir, rank, settings.start_step, transport,
        run_id=settings.run_id, redis_url=settings.redis_url, ranks=settings.ranks,
    )  # fmt: skip
    try:
        for step in settings.step_numbers:
            receiver.wait()
            micro_batches = receiver.receive()
            assert micro_batches, f"rank {rank} step {step}: an empty payload"
            got[rank].append(step)
            if rank == 0:
                announce(settings, step)
    finally:
        receiver.close()


def train_like_stock_prime_rl(settings: RunSettings, rank: int, got: dict[int, list[int]]) -> None:
    """What prime-rl's own ZMQ receiver does: subscribe to `data_rank|{rank}|`, announce
    READY once, and count each message as the next step (no run id, no duplicate check)."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://{settings.zmq_host}:{settings.zmq_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"data_rank|%d|" % rank)
    ready = context.socket(zmq.PUSH)
    ready.connect(f"tcp://{settings.zmq_host}:{settings.zmq_port + 1}")
    ready.send(str(rank).encode())
    try:
        for step in settings.step_numbers:
            _, payload = sub.recv_multipart()
            assert decode_microbatches(payload), f"rank {rank} step {step}: an empty payload"
            got[rank].append(step)
            if rank == 0:
                announce(settings, step)
    finally:
        context.destroy(linger=0)


# -- rlship's side, as you would start it ----------------------------------------------------


def start_rlship(settings: RunSettings, log_dir: Path) -> list[subprocess.Popen]:
    """The Celery workers (one process owns the run's ZMQ sockets) and the orchestrator,
    as an operator starts them: `celery -A tasks worker ...` and `rlship orchestrate ...`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "REDIS_URL": settings.redis_url}
    worker = [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--prefetch-multiplier", "1",
              "--without-gossip", "--without-mingle", "--loglevel", "WARNING"]  # fmt: skip
    commands = {
        "cpu-worker": [*worker, "-Q", settings.cpu_queue, "-c", "2", "-n", f"cpu-{settings.run_id}@%h"],
        "ship-worker": [*worker, "-Q", settings.ship_queue, "-c", "1", "-n", f"ship-{settings.run_id}@%h"],
        "orchestrator": [
            sys.executable, "-m", "orchestrator.commands.cli", "orchestrate",
            "--run-id", settings.run_id, "--steps", str(settings.steps), "--ranks", str(settings.ranks),
            "--trainers", "external", "--zmq-port", str(settings.zmq_port),
            "--batch-size", str(settings.batch_size), "--group-size", str(settings.group_size),
            "--seq-len", str(settings.seq_len), "--output-dir", str(settings.output_dir),
        ],
    }  # fmt: skip
    return [
        subprocess.Popen(
            command, env=env, stdout=open(log_dir / f"{name}.log", "ab"), stderr=subprocess.STDOUT
        )
        for name, command in commands.items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--receivers", choices=("prime", "stock"), default="prime")
    parser.add_argument("--zmq-port", type=int, default=5555)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/own-loop"))
    parser.add_argument("--run-id", default=f"own-loop-{uuid.uuid4().hex[:6]}")
    args = parser.parse_args()
    settings = RunSettings(
        run_id=args.run_id,
        redis_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        steps=args.steps,
        ranks=args.ranks,
        trainers="external",  # numbered from 1, as prime-rl counts; the gate reads the broadcasts
        zmq_port=args.zmq_port,
        batch_size=16,
        group_size=4,
        seq_len=512,
        output_dir=args.output_dir.resolve(),
    )
    announce(settings, 0)  # the weights the trainers start from
    rlship_side = start_rlship(settings, settings.output_dir / "logs")
    train = train_with_rlship_receiver if args.receivers == "prime" else train_like_stock_prime_rl
    got: dict[int, list[int]] = {rank: [] for rank in range(settings.ranks)}
    ranks = [
        threading.Thread(target=train, args=(settings, rank, got), daemon=True)
        for rank in range(settings.ranks)
    ]
    stop = threading.Event()
    producer = threading.Thread(
        target=inference_loop, args=(settings.redis_url, settings.run_id, stop), daemon=True
    )
    try:
        for thread in [*ranks, producer]:
            thread.start()
        for thread in ranks:
            thread.join(timeout=120)
        orchestrator = rlship_side[-1]
        shipped = orchestrator.wait(timeout=60) == 0
    finally:
        stop.set()
        for process in rlship_side:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in rlship_side:
            process.wait(timeout=30)
        producer.join(timeout=10)
        # The run is over and its workers are gone: its queues (and kombu's bindings of them) too.
        queues = (settings.cpu_queue, settings.ship_queue)
        connect_redis(settings.redis_url).delete(
            *queues, *(f"_kombu.binding{kind}.{queue}" for kind in ("", "_permanent") for queue in queues)
        )
    wanted = list(settings.step_numbers)
    for rank, steps in got.items():
        print(f"rank {rank}: received steps {steps}")
    complete = shipped and all(steps == wanted for steps in got.values())
    print(f"own loop, run {settings.run_id}: {'every rank got every step' if complete else 'INCOMPLETE'}")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
