"""The endpoint's metrics that other processes count in the run's Redis, read in one
pipelined round trip per scrape on the endpoint's thread: the tasks' queue waits and failures
(`transport.task_metrics`, from the workers), the trainer ranks' idle seconds, rollouts and
bytes into and out of the byte budget (the produce script and the release scripts,
`transport.store`), the newest record's publication and staleness, and Redis' own memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from orchestrator.settings import RunSettings
from tasks.graph import STAGE_NAMES
from tasks.stages.record_names import staleness_max
from transport.keys import RunKeys
from transport.task_metrics import queue_wait_histograms

# name -> (family, help text); a counter's name gets `_total` when exposed.
METRICS: dict[str, tuple[type[Metric], str]] = {
    "rlship_queue_wait_seconds": (
        HistogramMetricFamily,
        "seconds a task waited in its queue, from its enqueue (a retry: its due time) to its start",
    ),
    "rlship_task_failures": (
        CounterMetricFamily,
        "task deliveries that raised, or were delivered again after their worker was lost",
    ),
    "rlship_trainer_idle_seconds": (
        CounterMetricFamily,
        "seconds rlship's trainer rank waited with no step to take",
    ),
    "rlship_rollouts_produced": (CounterMetricFamily, "rollouts producers wrote into the run"),
    "rlship_rollouts_released": (
        CounterMetricFamily,
        "rollouts whose bytes left the run (shipped and released, or never to ship)",
    ),
    "rlship_rollout_bytes_produced": (
        CounterMetricFamily,
        "bytes of the rollouts producers wrote (blobs and rows files)",
    ),
    "rlship_rollout_bytes_released": (CounterMetricFamily, "bytes of the rollouts released"),
    "rlship_held_bytes_limit_bytes": (GaugeMetricFamily, "the run's byte budget, max_held_bytes (0: none)"),
    "rlship_last_publish_timestamp_seconds": (
        GaugeMetricFamily,
        "unix time the newest record was published",
    ),
    "rlship_policy_staleness_steps": (
        GaugeMetricFamily,
        "the newest record's off_policy/max (rlship-1: off_policy/staleness/max)",
    ),
    "rlship_policy_staleness_limit_steps": (
        GaugeMetricFamily,
        "max_off_policy_steps: rollouts any more steps off-policy are discarded as stale",
    ),
    "rlship_redis_memory_used_bytes": (GaugeMetricFamily, "Redis INFO memory used_memory"),
    "rlship_redis_memory_max_bytes": (GaugeMetricFamily, "Redis INFO memory maxmemory (0: none)"),
}


def _decoded(raw: dict[bytes, bytes]) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in raw.items()}


class RunGauges:
    """Reads and yields the metrics of the module docstring for one run."""

    def __init__(self, client: redis.Redis, settings: RunSettings) -> None:
        self.client = client
        self.keys = RunKeys(settings.run_id)
        self.run = [settings.run_id]
        self.held_bytes_limit = settings.max_held_bytes  # 0: no byte budget
        self.staleness_limit = settings.max_off_policy_steps

    def collect(self, newest_step: int, newest_record: dict[str, float] | None) -> Iterator[Metric]:
        """The metrics, given the newest step the orchestrator followed and its record."""
        keys = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(keys.queue_wait)
        pipe.hgetall(keys.task_failures)
        pipe.hgetall(keys.trainer_idle)
        pipe.hgetall(keys.rollout_flow)
        pipe.get(keys.produced)
        pipe.hget(keys.published, newest_step)
        pipe.info("memory")
        waits, failures, idle, flow, produced, published_at, memory = pipe.execute()
        yield self._queue_waits(waits)
        # Every stage from 0: a first failure is then a rise that increase() and the alert see
        # (a series' first sample is none), and the board has each stage's line from the start.
        failed = {**dict.fromkeys(STAGE_NAMES, 0.0), **_decoded(failures)}
        yield self._labelled("rlship_task_failures", "stage", failed)
        yield self._labelled("rlship_trainer_idle_seconds", "rank", _decoded(idle))
        flows = _decoded(flow)
        values: dict[str, float | None] = {
            "rlship_rollouts_produced": float(produced or 0),
            "rlship_rollouts_released": flows.get("released", 0.0),
            "rlship_rollout_bytes_produced": flows.get("produced_bytes", 0.0),
            "rlship_rollout_bytes_released": flows.get("released_bytes", 0.0),
            "rlship_held_bytes_limit_bytes": self.held_bytes_limit,
            "rlship_last_publish_timestamp_seconds": None if published_at is None else float(published_at),
            "rlship_policy_staleness_steps": _staleness(newest_record),
            "rlship_policy_staleness_limit_steps": self.staleness_limit,
            "rlship_redis_memory_used_bytes": memory["used_memory"],
            "rlship_redis_memory_max_bytes": memory["maxmemory"],
        }
        for name, value in values.items():
            kind, text = METRICS[name]
            metric = kind(name, text, labels=["run_id"])
            if value is not None:
                metric.add_metric(self.run, value)
            yield metric

    def _labelled(self, name: str, label: str, values: dict[str, float]) -> Metric:
        kind, text = METRICS[name]
        metric = kind(name, text, labels=["run_id", label])
        for value_label, value in sorted(values.items()):
            metric.add_metric([*self.run, value_label], value)
        return metric

    def _queue_waits(self, raw: dict[bytes, bytes]) -> Metric:
        name = "rlship_queue_wait_seconds"
        metric = HistogramMetricFamily(name, METRICS[name][1], labels=["run_id", "queue"])
        for kind, histogram in queue_wait_histograms(raw).items():
            buckets = [(floatToGoString(bound), count) for bound, count in histogram.buckets]
            metric.add_metric([*self.run, kind], buckets, histogram.total)
        return metric


def _staleness(record: dict[str, float] | None) -> float | None:
    value = None if record is None else staleness_max(record)
    return None if value is None or math.isnan(value) else value
