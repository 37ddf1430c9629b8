"""The orchestrator's Prometheus endpoint (`metrics_port`): the run's gauges, counters and
histograms, read when scraped, on the HTTP server's thread. Most come from Redis (the
status hash, the step marks, the queues, as `rlship status` reads them; what the workers
and ranks count, `orchestrator.run_gauges`), so a scrape costs the event loop nothing; the
stage, ship and loop-lag histograms (`orchestrator.step_metrics`), the loop's worst lag and
the records mirrored come from the orchestrator's components; the workers that answer from
a thread that asks them in the background (`orchestrator.worker_liveness`). With
`Accept: application/openmetrics-text` the stage histograms carry exemplars.
docs/metrics.md lists every metric."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from orchestrator.run_gauges import RunGauges
from orchestrator.run_info import RunInfo
from orchestrator.status_reader import STAGES, StatusReader, in_flight
from orchestrator.step_metrics import StepMetrics
from orchestrator.worker_liveness import WorkerLiveness
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.outcomes import outcome_counts

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from orchestrator.follower import RecordFollower
    from orchestrator.lag_probe import LagProbe
    from orchestrator.settings import RunSettings


class RunCollector(Collector):
    def __init__(
        self,
        settings: RunSettings,
        follower: RecordFollower,
        probe: LagProbe,
        step_metrics: StepMetrics,
        liveness: WorkerLiveness,
    ) -> None:
        self.follower = follower
        self.probe = probe
        self.step_metrics = step_metrics
        self.liveness = liveness
        self.keys = RunKeys(settings.run_id)
        self.info = RunInfo.from_settings(settings)
        self.client = connect_redis(
            settings.redis_url, ride_out_outages=False, socket_timeout=5, socket_connect_timeout=5
        )
        self.gauges = RunGauges(self.client, settings)
        self._reader: StatusReader | None = None
        self._lock = threading.Lock()  # scrapes may overlap; the reader keeps a cursor

    def _metric(self, kind: type[Metric], name: str, text: str, *labels: str) -> Metric:
        return kind(name, text, labels=["run_id", *labels])

    def payload_bytes(self) -> int:
        """Bytes of the per-rank payloads Redis holds (cut steps' and those kept for replay)."""
        keys = self.keys
        steps = [int(s) for s in self.client.zrange(keys.retained_payloads, 0, -1)]
        pipe = self.client.pipeline(transaction=False)
        for step in steps:
            for rank in range(self.info.ranks):
                pipe.strlen(keys.payload(step, rank))
        return sum(pipe.execute()) if steps else 0

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if self._reader is None:
                self._reader = StatusReader(self.client, self.info.run_id, self.info.queues, self.info.ranks)
            snapshot = self._reader.snapshot()
            published = int(self.client.hlen(self.keys.published))
            payload_bytes = self.payload_bytes()
            held_bytes = int(self.client.get(self.keys.held_bytes_total) or 0)
            outcomes = outcome_counts(self.client, self.keys)
        status, run = snapshot.status, [self.info.run_id]
        start = self.info.start_step
        values: list[tuple[type[Metric], str, str, float]] = [
            (CounterMetricFamily, "rlship_steps_shipped", "steps whose record is published", published),
            (CounterMetricFamily, "rlship_steps_cut", "steps cut and handed to the workers",
             status.get("next_step", start) - start),
            (CounterMetricFamily, "rlship_records", "records this orchestrator wrote to metrics.jsonl",
             self.follower.records_published),
            (CounterMetricFamily, "rlship_rollouts_arrived", "rollout records read from the stream",
             status.get("arrived", 0)),
            (GaugeMetricFamily, "rlship_steps_wanted", "steps the run ships", self.info.steps),
            (GaugeMetricFamily, "rlship_rollouts_pending", "trainable rollouts waiting for a step",
             status.get("pending", 0)),
            (GaugeMetricFamily, "rlship_rollouts_open", "rollouts whose group is not complete",
             status.get("in_open_groups", 0)),
            (GaugeMetricFamily, "rlship_stalled_ranks", "ranks the policy gate waits on",
             len(snapshot.stalled_ranks)),
            (GaugeMetricFamily, "rlship_payload_bytes", "bytes of encoded per-rank payloads held in Redis",
             payload_bytes),
            (GaugeMetricFamily, "rlship_held_bytes",
             "bytes held for the producers' budget (max_held_bytes), in Redis and files", held_bytes),
            (GaugeMetricFamily, "rlship_event_loop_lag_max_seconds",
             "the orchestrator's worst event-loop lag since it started",
             self.probe.max_ms / 1000),
        ]  # fmt: skip
        for kind, name, text, value in values:
            metric = self._metric(kind, name, text)
            metric.add_metric(run, value)
            yield metric
        tasks = self._metric(GaugeMetricFamily, "rlship_tasks_in_flight", "tasks queued or running", "stage")
        counts = in_flight(snapshot.steps, self.info.ranks)
        for stage in STAGES:
            tasks.add_metric([*run, stage], counts[stage])
        yield tasks
        yield from self._outcome_counters(outcomes, run)
        queued = self._metric(GaugeMetricFamily, "rlship_queue_depth", "messages in a Celery queue", "queue")
        for queue, length in snapshot.queued.items():
            queued.add_metric([*run, queue], length)
        yield queued
        workers = self._metric(
            GaugeMetricFamily,
            "rlship_workers_up",
            "workers consuming the run's queue (cpu, ship) that answer",
            "queue",
        )
        for kind, count in sorted(self.liveness.counts.items()):
            workers.add_metric([*run, kind], count)
        yield workers
        newest = self.follower.records[-1] if self.follower.records else None
        yield from self.gauges.collect(self.follower.last_published, newest)
        yield from self.step_metrics.collect()

    def _outcome_counters(self, counts: dict[str, int], run: list[str]) -> Iterator[Metric]:
        """Rollouts that did not ship, by what became of them and why (transport.outcomes):
        dropped by the workers at the cut (by offending field), discarded by the orchestrator
        (by reason), rejected at ingest (by reason); each rollout counted once."""
        texts = {
            "dropped": "cut rollouts the workers dropped, by offending field or prune rule",
            "discarded": "rollouts discarded before a cut (zero_advantage, error, cancelled, stale, ...)",
            "rejected": "rollout records rejected at ingest, by reason",
        }
        for kind, text in texts.items():
            metric = self._metric(CounterMetricFamily, f"rlship_rollouts_{kind}", text, "reason")
            for name, count in sorted(counts.items()):
                if name.startswith(f"{kind}/"):
                    metric.add_metric([*run, name.removeprefix(f"{kind}/")], count)
            yield metric


class MetricsEndpoint:
    """The served endpoint and the thread asking the workers; `close` stops both."""

    def __init__(self, server: WSGIServer, liveness: WorkerLiveness) -> None:
        self.server = server
        self.liveness = liveness

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.liveness.stop()


def serve_metrics(
    settings: RunSettings, follower: RecordFollower, probe: LagProbe, step_metrics: StepMetrics
) -> MetricsEndpoint:
    """Start the endpoint on `metrics_host:metrics_port`; a port that cannot be bound stops
    start-up naming the setting."""
    liveness = WorkerLiveness(settings.redis_url, RunInfo.from_settings(settings))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(settings, follower, probe, step_metrics, liveness))
    try:
        server, _thread = start_http_server(settings.metrics_port, settings.metrics_host, registry)
    except OSError as exc:
        raise OSError(
            f"metrics_port: cannot serve Prometheus metrics on {settings.metrics_host}:"
            f"{settings.metrics_port}: {exc.strerror or exc}"
        ) from None
    liveness.start()
    return MetricsEndpoint(server, liveness)
