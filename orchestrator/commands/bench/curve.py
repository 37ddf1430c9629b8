"""`rlship bench curve`: what CURVE costs the ZMQ transport: the sender's and the receivers'
CPU a step, plain and with CURVE, side by side (BENCHMARKS.md, "CURVE"). The sender is this
process (user + system of every thread: libzmq's I/O thread does the encryption); each rank
is a spawned process reporting its own. Variants alternate, `--rounds` times each.

    rlship bench curve --steps 30 --rank-mib 11.2 --ranks 2 --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
from pathlib import Path

from transport.zmq_curve import client_keys, make_keys, server_keys
from transport.zmq_receiver import ZMQReceiver
from transport.zmq_sender import ZMQSender
from transport.zmq_sockets import free_port_pair

HOST = "127.0.0.1"
WAIT = 60.0


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rank_main(port: int, rank: int, steps: int, keys: str | None, results: mp.Queue) -> None:
    curve = client_keys(Path(keys), rank) if keys else None
    with ZMQReceiver(HOST, port, rank, run_id="bench", next_step=0, curve=curve) as receiver:
        first = receiver.receive(WAIT)  # the warm-up step: CPU counted from here
        assert first is not None
        start = cpu_seconds()
        for _ in range(steps):
            assert receiver.receive(WAIT) is not None
        results.put(cpu_seconds() - start)


def one_round(steps: int, ranks: int, payload: bytes, keys: Path | None) -> tuple[float, float]:
    """(sender CPU s a step, every rank's CPU s a step) over `steps` steps after a warm-up."""
    ctx = mp.get_context("spawn")
    port, results = free_port_pair(), ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(port, r, steps, str(keys) if keys else None, results))
        for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    curve = server_keys(keys, ranks) if keys else None
    with ZMQSender(HOST, port, ranks, run_id="bench", curve=curve, send_timeout=WAIT) as sender:
        assert sender.wait_ready(WAIT)
        for rank in range(ranks):
            sender.send(0, rank, payload)
        start = cpu_seconds()
        for step in range(1, steps + 1):
            for rank in range(ranks):
                sender.send(step, rank, payload)
        sender_cpu = cpu_seconds() - start
        ranks_cpu = sum(results.get(timeout=WAIT) for _ in range(ranks))
    for proc in procs:
        proc.join(WAIT)
    return sender_cpu / steps, ranks_cpu / steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rank-mib", type=float, default=11.2, help="payload per rank a step")
    parser.add_argument("--rounds", type=int, default=3)


def main(args: argparse.Namespace) -> int:
    payload = os.urandom(int(args.rank_mib * (1 << 20)))
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        make_keys(keys, args.ranks)
        found: dict[str, list[tuple[float, float]]] = {"plain": [], "curve": []}
        for _ in range(args.rounds):
            for name, variant_keys in (("plain", None), ("curve", keys)):
                found[name].append(one_round(args.steps, args.ranks, payload, variant_keys))
    medians = {
        name: (statistics.median(s for s, _ in rounds), statistics.median(r for _, r in rounds))
        for name, rounds in found.items()
    }
    for name, (sender, ranks) in medians.items():
        rounds = ", ".join(f"{s * 1000:.1f}" for s, _ in found[name])
        print(f"{name}: sender {sender * 1000:.1f} ms a step (rounds {rounds}); ranks {ranks * 1000:.1f} ms")
    (plain, _), (curve, _) = medians["plain"], medians["curve"]
    print(f"curve - plain, sender: {(curve - plain) * 1000:.1f} ms a step; ratio {curve / plain:.2f}x")
    return 0
