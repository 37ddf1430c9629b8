"""Reading the orchestrator's Prometheus endpoint as a scraper does, and serving it on a
finished run's own components."""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from orchestrator.exporter import MetricsEndpoint, serve_metrics
from orchestrator.settings import RunSettings
from transport.zmq_sockets import free_port_pair

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def exposition(port: int, openmetrics: bool = False) -> str:
    """The endpoint's text, in Prometheus' text format or, asked as Prometheus asks for
    exemplars, OpenMetrics."""
    headers = {"Accept": OPENMETRICS} if openmetrics else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


def run_samples(port: int, run_id: str, openmetrics: bool = False) -> dict[str, list[Sample]]:
    """Every family of the run (`rlship_*`, by the name it is exposed under), with its samples
    of the run; a family with no sample yet is there, empty."""
    text = exposition(port, openmetrics)
    parse = openmetrics_families if openmetrics else text_string_to_metric_families
    return {
        family.name: [s for s in family.samples if s.labels.get("run_id") == run_id]
        for family in parse(text)
        if family.name.startswith("rlship_")
    }


def scrape(port: int, run_id: str) -> dict[str, float]:
    """The endpoint's samples of the run's metrics: `name` or `name:label_value` -> value."""
    samples = {}
    for family in run_samples(port, run_id).values():
        for sample in family:
            labels = dict(sample.labels)
            labels.pop("run_id")
            samples[":".join([sample.name, *labels.values()])] = sample.value
    return samples


def serve_finished_run(orchestrator: Any, settings: RunSettings) -> tuple[MetricsEndpoint, int]:
    """The endpoint served on a finished run's own components (its orchestrator's follower,
    lag probe and step metrics) on a free port, and the port."""
    port = free_port_pair()
    endpoint = serve_metrics(
        settings.with_changes(metrics_port=port),
        orchestrator.follower,
        orchestrator.probe,
        orchestrator.step_metrics,
    )
    return endpoint, port
