"""The orchestrator's own responsiveness: how late its event loop wakes a sleeper."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable

import numpy as np


class LagProbe:
    """Measures how late the loop wakes a 10 ms sleeper: the loop's responsiveness.

    With `keep_timeline`, every observation is also kept with its loop time (`times`,
    `lags_ms`), so a benchmark can say when the loop stalled, not only how much.
    """

    def __init__(self, interval: float = 0.01, keep_timeline: bool = False) -> None:
        self.interval = interval
        self._window = array("d")
        self.max_ms = 0.0
        self.recent_max_ms = 0.0
        self.samples = 0
        self.times: array | None = array("d") if keep_timeline else None
        self.lags_ms = array("d")
        self.on_sample: Callable[[float], None] | None = None  # each lag, in seconds

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(self.interval)
            now = loop.time()
            lag_ms = max(0.0, (now - started - self.interval) * 1000.0)
            self._window.append(lag_ms)
            self.max_ms = max(self.max_ms, lag_ms)
            self.recent_max_ms = max(self.recent_max_ms, lag_ms)
            self.samples += 1
            if self.on_sample is not None:
                self.on_sample(lag_ms / 1000.0)
            if self.times is not None:
                self.times.append(now)
                self.lags_ms.append(lag_ms)

    def take_recent_max(self) -> float:
        """The worst lag since the previous call (for the live status)."""
        worst, self.recent_max_ms = self.recent_max_ms, 0.0
        return worst

    def take_window(self) -> np.ndarray:
        """The observations since the previous call (for the next record)."""
        window = np.frombuffer(self._window, dtype=np.float64).copy()
        self._window = array("d")
        return window

    def put_back(self, window: np.ndarray) -> None:
        """Return a taken window (its cut was taken back): the next take includes it, first."""
        self._window = array("d", window.tolist()) + self._window
