"""A trainer rank written from docs/transports.md's ZMQ section with plain pyzmq, for tests whose
oracle must not be the code under test: no rlship receiver, no dedup, no replay. It keeps
every message exactly as it arrived, duplicates included, so a test can count what a
trainer really got and decode the bytes itself."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter

import zmq


class WireTrainer:
    """Every rank's SUB (prefix `data_rank|{rank}|`) and READY announcer, on one thread; a
    topic is `data_rank|{rank}|{step}|{run_id}`. READY is the bare rank, as a stock rank's."""

    def __init__(self, host: str, port: int, ranks: int) -> None:
        self.messages: list[tuple[int, int, bytes]] = []  # (rank, step, payload), in arrival order
        self.run_ids: set[str] = set()  # the runs the topics named
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(host, port, ranks), daemon=True)

    def __enter__(self) -> WireTrainer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self, host: str, port: int, ranks: int) -> None:
        context = zmq.Context()
        poller = zmq.Poller()
        subs, pushes = [], []
        for rank in range(ranks):
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"data_rank|%d|" % rank)
            sub.connect(f"tcp://{host}:{port}")
            poller.register(sub, zmq.POLLIN)
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 1)
            push.connect(f"tcp://{host}:{port + 1}")
            subs.append(sub)
            pushes.append((rank, push))
        announced = 0.0
        while not self._stop.is_set():
            if time.monotonic() - announced > 0.5:  # READY, again and again (the sender may restart)
                announced = time.monotonic()
                for rank, push in pushes:
                    with contextlib.suppress(zmq.Again):
                        push.send(str(rank).encode(), zmq.NOBLOCK)
            for sub, _ in poller.poll(100):
                topic, payload = sub.recv_multipart()
                _, rank, step, run_id = topic.split(b"|", 3)
                with self._lock:
                    self.messages.append((int(rank), int(step), payload))
                    self.run_ids.add(run_id.decode())
        context.destroy(linger=0)

    def received(self) -> list[tuple[int, int, bytes]]:
        with self._lock:
            return list(self.messages)

    def counts(self) -> Counter[tuple[int, int]]:
        """How many messages each (rank, step) got."""
        return Counter((rank, step) for rank, step, _ in self.received())

    def wait_for(self, expected: set[tuple[int, int]], timeout: float = 30.0) -> None:
        """Until every (rank, step) in `expected` has arrived at least once."""
        deadline = time.monotonic() + timeout
        while not expected <= set(self.counts()):
            if time.monotonic() > deadline:
                missing = sorted(expected - set(self.counts()))
                raise AssertionError(f"never reached the trainer within {timeout} s: {missing}")
            time.sleep(0.02)
