"""Reading the orchestrator's Prometheus endpoint as a scraper does."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int, run_id: str) -> dict[str, float]:
    """The endpoint's samples of the run's metrics: `name` or `name:label_value` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if sample.name.startswith("rlship_") and labels.pop("run_id") == run_id:
                samples[":".join([sample.name, *labels.values()])] = sample.value
    return samples
