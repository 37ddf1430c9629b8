"""The orchestrator's own histograms for its Prometheus endpoint: each shipped step's stage
seconds and ship seconds (observed once the step is released, from what its tasks left in
`RunKeys.stage_seconds`), and every sample of the event-loop lag probe.

They live in the orchestrator process (a stage histogram's exemplar is the step's trace
id, which the orchestrator holds) and are not registered anywhere global: each run's are
its own, collected by its endpoint (`orchestrator.exporter`). Observing costs the event
loop a lock and a bucket search.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import redis.asyncio as aioredis
from prometheus_client import Histogram
from prometheus_client.core import Metric

from tasks.graph import STAGE_NAMES
from transport.keys import RunKeys

# Seconds: a stage computes in milliseconds to a minute (a large step's encode, a send to a slow rank).
STAGE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# A step's cut to its record: seconds to minutes behind a slow trainer or a backlog.
SHIP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# The probe's lag: well under a millisecond on a healthy loop; a stall is tens to hundreds.
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SHIP = "ship"  # `RunKeys.stage_seconds`' name of a step's `time/ship`


class StepMetrics:
    """One run's stage, ship and loop-lag histograms, each with the `run_id` label."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.stage_seconds = Histogram(
            "rlship_stage_duration_seconds",
            "seconds a stage of a shipped step computed (a per-rank stage: its slowest rank), queue waits "
            "left out",
            labelnames=["run_id", "stage"],
            buckets=STAGE_BUCKETS,
            registry=None,
        )
        self.ship_seconds = Histogram(
            "rlship_step_ship_duration_seconds",
            "seconds from a step's cut to its record's publication (time/ship)",
            labelnames=["run_id"],
            buckets=SHIP_BUCKETS,
            registry=None,
        )
        self.loop_lag = Histogram(
            "rlship_event_loop_lag_seconds",
            "how late the orchestrator's event loop woke a 10 ms sleeper, every probe",
            labelnames=["run_id"],
            buckets=LAG_BUCKETS,
            registry=None,
        )
        # Each label set's child, looked up once (a lookup takes the metric's lock).
        self._stages = {stage: self.stage_seconds.labels(run_id, stage) for stage in STAGE_NAMES}
        self._ship = self.ship_seconds.labels(run_id)
        self._lag = self.loop_lag.labels(run_id)

    def observe_step(self, seconds: Mapping[str, float], exemplar: dict[str, str] | None = None) -> None:
        """Observe one shipped step's timings (stage name or `ship` -> seconds); `exemplar`
        (the step's trace id) goes with each observation."""
        for stage, child in self._stages.items():
            if stage in seconds:
                child.observe(seconds[stage], exemplar)
        if SHIP in seconds:
            self._ship.observe(seconds[SHIP], exemplar)

    def observe_lag(self, lag_seconds: float) -> None:
        """The lag probe's hook: one sample."""
        self._lag.observe(lag_seconds)

    def collect(self) -> Iterator[Metric]:
        for histogram in (self.stage_seconds, self.ship_seconds, self.loop_lag):
            yield from histogram.collect()


async def take_step_seconds(client: aioredis.Redis, keys: RunKeys, step: int) -> dict[str, float]:
    """A released step's timings its tasks left (`RunKeys.stage_seconds`), taken out of the
    hash (it holds only steps not yet observed)."""
    names = [*STAGE_NAMES, SHIP]
    fields = [f"{step}:{name}" for name in names]
    pipe = client.pipeline(transaction=True)
    pipe.hmget(keys.stage_seconds, fields)
    pipe.hdel(keys.stage_seconds, *fields)
    values, _ = await pipe.execute()
    return {name: float(value) for name, value in zip(names, values, strict=True) if value is not None}
