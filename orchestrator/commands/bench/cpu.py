"""CPU seconds per shipped step, by process kind, for `rlship bench loop`.

A sampler thread in the bench process reads every watched process tree's cumulative CPU
(user + system of the process, of its live descendants, and of those it has reaped: a
Celery pool child replaced mid-run still counts) and the machine's busy CPU
(/proc/stat) every `interval` seconds on the monotonic clock, which the orchestrator
process's loop shares. A step's CPU per kind is the difference of those totals, linearly
interpolated, at its ship window's ends (cut to published record). The kernel counts CPU
in clock ticks (10 ms each, per process), so single-step figures are coarse; medians over
several steps are not. `others` is the machine's busy CPU minus every watched tree and
the bench process itself: work of other programs on the machine during the window.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import psutil

# The kinds whose sum is the ship path's CPU; trainer ranks are reported apart.
SHIP_KINDS: tuple[str, ...] = ("orchestrator", "workers", "redis")
SAMPLE_SECONDS = 0.02
CHILDREN_REFRESH_SECONDS = 1.0


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_and_reaped(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


class CpuSampler:
    """Cumulative CPU of process trees grouped by kind, sampled in a daemon thread."""

    def __init__(self, roots: Mapping[str, list[int]], interval: float = SAMPLE_SECONDS) -> None:
        self.roots = {kind: [psutil.Process(pid) for pid in pids] for kind, pids in roots.items()}
        self.interval = interval
        self.times: list[float] = []
        self.samples: list[list[float]] = []  # per sample: each kind, then machine, then this process
        self._trees: dict[str, list[psutil.Process]] = {}
        self._refreshed = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    @property
    def kinds(self) -> list[str]:
        return list(self.roots)

    def start(self) -> None:
        self._sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _tree(self, kind: str) -> list[psutil.Process]:
        """The kind's roots and their live descendants (refreshed now and then: the scan of
        /proc that finds children costs more than a sample)."""
        now = time.monotonic()
        if now - self._refreshed > CHILDREN_REFRESH_SECONDS:
            self._trees.clear()
            self._refreshed = now
        if kind not in self._trees:
            tree = []
            for root in self.roots[kind]:
                try:
                    tree += [root, *root.children(recursive=True)]
                except psutil.Error:
                    tree.append(root)  # gone: its last figure is kept by _cpu
            self._trees[kind] = tree
        return self._trees[kind]

    def _cpu(self, kind: str, last: float) -> float:
        total = 0.0
        for process in self._tree(kind):
            try:
                total += _own_and_reaped(process)
            except psutil.Error:
                continue
        return max(total, last)  # a child exiting between two reads must not make time run back

    def _sample(self) -> None:
        last = self.samples[-1] if self.samples else [0.0] * (len(self.roots) + 2)
        row = [self._cpu(kind, last[i]) for i, kind in enumerate(self.roots)]
        row += [machine_cpu_seconds(), _own_and_reaped(psutil.Process())]
        self.times.append(time.monotonic())
        self.samples.append(row)

    def in_windows(self, windows: list[tuple[float, float]]) -> list[dict[str, float]]:
        """Per window (monotonic start, end): CPU seconds of each kind, `ship` (the sum of
        SHIP_KINDS present) and `others` (the machine less every watched tree and the bench)."""
        t = np.asarray(self.times)
        samples = np.asarray(self.samples)
        out = []
        for start, end in windows:
            used = np.array([np.interp(end, t, column) - np.interp(start, t, column) for column in samples.T])
            per_kind = dict(zip(self.kinds, used[: len(self.kinds)].tolist(), strict=True))
            watched = float(used[: len(self.kinds)].sum() + used[-1])
            out.append(
                {
                    **per_kind,
                    "ship": sum(per_kind.get(kind, 0.0) for kind in SHIP_KINDS),
                    "others": max(0.0, float(used[-2]) - watched),
                }
            )
        return out


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of every process it started and waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def other_cpu_share(before: tuple[float, float], wall: float) -> float:
    """The share of the machine's CPU that others (and Redis) used while the bench ran: the
    figures are only as quiet as the machine was."""
    others = (machine_cpu_seconds() - before[0]) - (own_cpu_seconds() - before[1])
    return max(0.0, others) / (wall * (os.cpu_count() or 1))
