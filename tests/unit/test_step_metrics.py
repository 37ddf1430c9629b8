"""The orchestrator's histograms as a scraper reads them over HTTP, and a task's queue wait
as the docs define it (docs/metrics.md, "Prometheus metrics"). No Redis: the histograms
are the orchestrator's own, served by prometheus_client's real HTTP server."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, start_http_server

from orchestrator.step_metrics import StepMetrics
from tasks.graph import STAGE_NAMES
from tests.support.processes import free_port
from tests.support.prometheus import exposition, run_samples
from transport.task_metrics import ENQUEUED_AT_HEADER, queue_wait_seconds


def test_a_step_observed_with_its_trace_id_shows_it_as_an_exemplar_in_openmetrics_only():
    metrics = StepMetrics("run-a")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    port = free_port()
    server, thread = start_http_server(port, "127.0.0.1", registry)
    try:
        metrics.observe_step({"finalize": 0.003, "send": 1.5, "ship": 4.0}, {"trace_id": "ab12"})
        metrics.observe_step({"finalize": 0.2})
        families = run_samples(port, "run-a", openmetrics=True)
        stage = families["rlship_stage_duration_seconds"]
        counts = {s.labels["stage"]: s.value for s in stage if s.name.endswith("_count")}
        # Every stage's series is there from the start, at 0 until observed.
        assert counts == {stage: 0 for stage in STAGE_NAMES} | {"finalize": 2, "send": 1}
        # The OpenMetrics exemplar of the bucket the observation fell in: 0.003 <= 0.005.
        marked = [(s.labels["stage"], s.labels["le"], s.exemplar) for s in stage if s.exemplar]
        assert [(name, le, e.labels, e.value) for name, le, e in marked] == [
            ("finalize", "0.005", {"trace_id": "ab12"}, 0.003),
            ("send", "2.5", {"trace_id": "ab12"}, 1.5),
        ]
        ship = [s for s in families["rlship_step_ship_duration_seconds"] if s.exemplar]
        assert [(s.labels["le"], s.exemplar.value) for s in ship] == [("5.0", 4.0)]
        assert " # {" not in exposition(port), "no exemplar in Prometheus' text format"
    finally:
        server.shutdown()
        thread.join(5)


def test_the_lag_histogram_counts_every_sample():
    metrics = StepMetrics("run-b")
    for lag in (0.0001, 0.002, 0.3):
        metrics.observe_lag(lag)
    samples = {(s.name, s.labels.get("le")): s.value for family in metrics.collect() for s in family.samples}
    assert samples[("rlship_event_loop_lag_seconds_count", None)] == 3
    assert samples[("rlship_event_loop_lag_seconds_bucket", "0.0025")] == 2
    assert samples[("rlship_event_loop_lag_seconds_bucket", "+Inf")] == 3


def test_a_retry_waits_from_its_due_time_not_its_publication():
    published = 1_000.0
    plain = SimpleNamespace(**{ENQUEUED_AT_HEADER: published, "eta": None})
    assert queue_wait_seconds(plain, published + 2.5) == 2.5
    due = datetime.fromtimestamp(published + 5.0, UTC).isoformat()  # a 5 s countdown
    retry = SimpleNamespace(**{ENQUEUED_AT_HEADER: published, "eta": due})
    assert queue_wait_seconds(retry, published + 5.25) == 0.25
    assert queue_wait_seconds(SimpleNamespace(eta=None), published) is None, "no header: no wait"
