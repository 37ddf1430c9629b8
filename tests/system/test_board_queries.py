"""The Grafana board (ops/grafana/dashboards/rlship-step.json) and the alert rules against a
real run scraped by a real Prometheus. Grafana itself is not installed here, so the board is
checked as data: its structure (every panel has a datasource and a query, the run_id
variable selects every rlship series, a stage panel links to traces) and every query's answer.

The live test starts `prometheus` (1 s scrapes and rule evaluations, the rules loaded) on a
small run's orchestrator endpoint, then asks its query API, over the whole time the run was
scraped, for every board query (`$run_id` filled in) and every alert expression. A short run
has seconds of data, so every range window (`[5m]`, `[$__rate_interval]`) is set to WINDOW
(`shorten_windows`): ten scrapes, as Grafana's `$__rate_interval` is at least four. Each board
query must show a number at some point of the run; each alert expression must be empty at
every point, every series an alert reads must exist (a misnamed one would keep it silent for
ever), and Prometheus' own evaluation of the loaded rules must never have made an alert
pending or firing (its ALERTS series). The orchestrator runs as a process of its own, tracing
to a real OTLP receiver: the exemplars of the stage panel's queries must be trace ids of the
run's steps."""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml

from orchestrator.admission import FINISHED, AdmissionRefused
from orchestrator.commands.produce import SyntheticWorkload
from orchestrator.producer import RolloutProducer
from orchestrator.settings import RunSettings
from tests.support.observability import (
    RULES,
    Prometheus,
    alert_rules,
    board,
    board_panels,
    board_queries,
    fill_variables,
    running_prometheus,
    shorten_windows,
)
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.processes import Workers, free_port, wait_for
from tests.support.shiprun import ship_settings, start_orchestrator, start_trainers
from tests.support.shiprun import stop as stop_processes
from transport.store import PayloadStore

WINDOW = "10s"
STEPS = 12
GROUP_EVERY_SECONDS = 0.4  # four groups a step: a step every ~2 s, a run of ~30 s
PANEL_TYPES = {"row", "stat", "timeseries", "gauge", "bargauge", "table", "heatmap", "text"}
# A metric name where PromQL names one: before a label matcher, a range, an operator or the end.
_METRIC = re.compile(r"\b(rlship_\w+)(\{[^}]*\})?")


def test_board_structure() -> None:
    data = board()
    assert data["uid"] and data["title"] and data["schemaVersion"] >= 30
    variables = {variable["name"]: variable for variable in data["templating"]["list"]}
    run = variables["run_id"]
    assert run["type"] == "query" and "rlship_" in run["definition"] and "run_id" in run["definition"]
    panels = board_panels()
    assert len({panel["id"] for panel in panels}) == len(panels), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        title, kind, grid = panel["title"], panel["type"], panel["gridPos"]
        assert kind in PANEL_TYPES, title
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, f"{title} is wider than the board"
        covered = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not covered & cells, f"{title} overlaps another panel"
        cells |= covered
        if kind == "row":
            continue
        assert panel["datasource"]["type"] == "prometheus" and panel["datasource"]["uid"], title
        assert panel.get("description"), f"{title}: say what the panel shows"
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), title
        for target in targets:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip(), title
            for name, matchers in _METRIC.findall(target["expr"]):
                assert 'run_id="$run_id"' in matchers, (
                    f"{title}: {name} is not selected by the run_id variable"
                )


def test_a_stage_panel_links_to_its_traces() -> None:
    """The stage histograms' exemplars carry trace ids (the datasource sends them to Jaeger):
    a stage panel asks for them, and links to the run's traces."""
    stage_panels = [
        panel
        for panel in board_panels()
        if any("rlship_stage_duration_seconds_bucket" in t.get("expr", "") for t in panel.get("targets", []))
    ]
    assert any(t.get("exemplar") for panel in stage_panels for t in panel["targets"])
    links = [
        link["url"] for panel in stage_panels for link in panel["fieldConfig"]["defaults"].get("links", [])
    ]
    assert any("${jaeger_url}" in url and "${run_id}" in url for url in links), links


def produce_paced(settings: RunSettings, stop: threading.Event) -> None:
    """The synthetic workload, one group every GROUP_EVERY_SECONDS, each stamped with the
    trainers' policy version (as `rlship produce` does, only slower): a run long enough for
    rates over WINDOW."""
    producer = RolloutProducer.for_run(redis.Redis.from_url(settings.redis_url), settings, wait=30)
    workload = SyntheticWorkload.for_run(settings)
    while not stop.is_set():
        group = workload.group()
        while not stop.is_set():
            version = producer.policy_version()
            try:
                producer.produce(
                    [(r.model_copy(update={"policy_version": version}), a) for r, a in group], 0.5
                )
                break
            except AdmissionRefused as refused:
                if refused.reason == FINISHED:  # the run shipped its steps before the test stopped us
                    return
                assert refused.passes, refused
        stop.wait(GROUP_EVERY_SECONDS)


def step_trace_ids(receiver: OtlpReceiver, run_id: str) -> set[str]:
    """The traces whose root is a step of the run (`rlship.step`, with its `rlship.run_id`)."""
    return {
        span.trace_id
        for span in receiver.received()
        if span.name == "rlship.step" and span.attributes.get("rlship.run_id") == run_id
    }


def finite(series: list[dict]) -> bool:
    return any(math.isfinite(float(value)) for s in series for _, value in s["values"])


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    running = OtlpReceiver().start()
    yield running
    running.stop()


def exemplar_trace_ids(prometheus: Prometheus, expr: str, start: float, end: float) -> set[str]:
    """The `trace_id`s of the exemplars Prometheus keeps for the series `expr` selects."""
    found = prometheus.api("query_exemplars", query=expr, start=start, end=end)
    return {
        exemplar["labels"].get("trace_id", f"no trace_id label in {exemplar['labels']}")
        for series in found
        for exemplar in series["exemplars"]
    }


@pytest.mark.timeout(300)
def test_every_board_query_and_alert_on_a_live_run(
    workers: Workers,
    client: redis.Redis,
    run_id: str,
    redis_url: str,
    tmp_path: Path,
    receiver: OtlpReceiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run's orchestrator (a process of its own, as the trainer ranks) traces to a real
    OTLP receiver: the stage panel's exemplars must name traces of the run's steps (what
    Grafana's exemplar link opens in Jaeger)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    port = free_port()
    rules = tmp_path / "rules.yml"
    groups = yaml.safe_load(RULES.read_text())
    for group in groups["groups"]:
        for rule in group["rules"]:
            rule["expr"] = shorten_windows(rule["expr"], WINDOW)
    rules.write_text(yaml.safe_dump(groups))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "rlship", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
    }
    settings = ship_settings(run_id, redis_url, workers, tmp_path / "run", steps=STEPS, metrics_port=port)
    with running_prometheus(config, tmp_path) as prometheus:
        began, stop = time.time(), threading.Event()
        ranks = start_trainers(settings)
        orchestrator = start_orchestrator(settings, tmp_path / "orchestrator.log")
        producer = threading.Thread(target=produce_paced, args=(settings, stop))
        producer.start()
        try:
            status = orchestrator.wait(180)
        finally:
            stop.set()
            producer.join()
            orchestrator.kill()
            stop_processes(ranks)
            PayloadStore(client, run_id).delete_all_rollouts()  # as `rlship run` does at the end
        assert status == 0, (tmp_path / "orchestrator.log").read_text()[-3000:]
        time.sleep(2)  # the scrape that finds the endpoint gone marks its series stale
        scraped = prometheus.query_range(f'rlship_steps_wanted{{run_id="{run_id}"}}', began, time.time(), 1)
        assert scraped, f"Prometheus never scraped the run ({tmp_path / 'prometheus.log'})"
        stamps = [stamp for stamp, _ in scraped[0]["values"]]
        start, end = stamps[0], stamps[-1]
        assert end - start > 2 * int(WINDOW[:-1]), f"the run was scraped for {end - start} s only"

        def over_run(expr: str) -> list[dict]:
            return prometheus.query_range(expr, start, end, 1)

        variables = {"run_id": run_id}
        empty = [
            f"{title}: {expr}"
            for title, expr in board_queries()
            if not finite(over_run(fill_variables(shorten_windows(expr, WINDOW), variables)))
        ]
        assert not empty, "board queries without data over the run:\n" + "\n".join(empty)

        fired, unread = {}, set()
        for rule in alert_rules():
            expr = shorten_windows(rule["expr"], WINDOW)
            answer = over_run(expr)
            if answer:
                fired[rule["alert"]] = answer[0]
            for name, _ in _METRIC.findall(expr):
                if not over_run(f'{name}{{run_id="{run_id}"}}'):
                    unread.add(name)
        assert not fired, f"alert expressions true on a healthy run scraped from {start} to {end}: {fired}"
        assert not unread, f"series alerts read that the run does not have: {sorted(unread)}"

        wait_for("the orchestrator's step spans", lambda: step_trace_ids(receiver, run_id), timeout=30)
        traced = step_trace_ids(receiver, run_id)
        for title, expr in board_queries(exemplars=True):
            linked = exemplar_trace_ids(
                prometheus, fill_variables(shorten_windows(expr, WINDOW), variables), start, end
            )
            assert linked and linked <= traced, (
                f"{title}: exemplars {sorted(linked)[:3]} not among the run's traces"
            )

        loaded = [r for g in prometheus.api("rules")["groups"] for r in g["rules"] if r["type"] == "alerting"]
        assert {r["name"] for r in loaded} == {r["alert"] for r in alert_rules()}
        assert all(r["health"] == "ok" for r in loaded), [(r["name"], r.get("lastError")) for r in loaded]
        assert over_run(f'ALERTS{{run_id="{run_id}"}}') == [], "Prometheus made an alert pending or firing"
