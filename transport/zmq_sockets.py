"""What both ends of the ZMQ step transport (docs/transports.md, "ZMQ") agree on: the port
pair a sender binds, the topic frame that routes a message to one rank and names its run,
the READY announcement, the endpoints and poll timeouts."""

from __future__ import annotations

import math
import random
import socket
from pathlib import Path
from typing import NamedTuple

TOPIC_PREFIX = b"data_rank|"


def rank_prefix(rank: int) -> bytes:
    """The subscription prefix of one rank; the trailing `|` keeps rank 1 from matching 10."""
    return b"%s%d|" % (TOPIC_PREFIX, rank)


class Topic(NamedTuple):
    """What a topic frame says: whose step it is. `run_id` is None for a sender that names
    no run (prime-rl's own, or rlship before run identity)."""

    rank: int
    step: int
    run_id: str | None


def topic(step: int, rank: int, run_id: str) -> bytes:
    """The first frame of a message: `data_rank|{rank}|{step}|{run_id}`. A stock prime-rl
    receiver subscribes to `data_rank|{rank}|` and still matches it; rlship's receivers
    take only their own run's steps."""
    return b"%s%d|%d|%s" % (TOPIC_PREFIX, rank, step, run_id.encode())


def parse_topic(frame: bytes) -> Topic | None:
    """What a topic frame names, or None if it is not one of ours."""
    parts = frame.split(b"|", 3)
    if len(parts) not in (3, 4) or parts[0] + b"|" != TOPIC_PREFIX:
        return None
    rank, step = parts[1], parts[2]
    # At most 18 digits: int() refuses over 4300, and no rank or step is near int64's 19.
    if not (rank.isdigit() and step.isdigit() and len(rank) <= 18 and len(step) <= 18) or parts[3:] == [b""]:
        return None
    run_id = parts[3].decode(errors="replace") if len(parts) == 4 else None
    return Topic(int(rank), int(step), run_id)


def ready_message(rank: int, run_id: str) -> bytes:
    """A rank's READY announcement, `{rank}|{run_id}`: the sender of another run ignores it.
    prime-rl's stock receivers send the rank alone."""
    return b"%d|%s" % (rank, run_id.encode())


def parse_ready(message: bytes) -> tuple[int, str | None] | None:
    """(rank, run_id) of a READY (run_id None: a stock rank's bare rank), or None if the
    message is not a READY."""
    rank, _, run_id = message.strip().partition(b"|")
    if not rank.isdigit():
        return None
    return int(rank), run_id.decode(errors="replace") if run_id else None


EPHEMERAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PAIR_PORT = 20000


def ephemeral_port_floor() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux's default where
    the range cannot be read)."""
    try:
        return int(EPHEMERAL_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def candidate_ports(tries: int = 100) -> list[int]:
    """Random ports from LOWEST_PAIR_PORT up to below the ephemeral range, each with room
    for its neighbour there too."""
    floor = max(ephemeral_port_floor(), LOWEST_PAIR_PORT + 2)
    return [random.randrange(LOWEST_PAIR_PORT, floor - 1) for _ in range(tries)]


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 free on `host`: the data and control ports of a sender.

    Chosen below the kernel's ephemeral range, which the pair is free of until the sender
    binds it: inside it, any process's next outgoing connection may take the port first (a
    worker's Redis connection did, in the bench), or a stock prime-rl rank dialling it
    before the sender binds may be given it as its own source port (a TCP self-connect)."""
    for port in candidate_ports():
        with socket.socket() as first:
            try:
                first.bind((host, port))
            except OSError:
                continue
            with socket.socket() as second:
                try:
                    second.bind((host, port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError(f"no free port pair on {host}")


def endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def poll_ms(seconds: float) -> int:
    """A zmq poll timeout in ms that never rounds a positive wait down to a busy 0."""
    return max(1, math.ceil(seconds * 1000))
