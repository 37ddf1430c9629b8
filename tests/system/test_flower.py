"""Flower, started by the Procfile's command line, watching a short real run: its API lists
every stage task of the shipped steps by name with (run id, step[, rank]) arguments and no
payload, succeeded with a runtime, and a failing task as failed with its exception; its
Prometheus endpoint counts them; and headless Chromium renders the tasks page listing them
(screenshot kept under artifacts/)."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.settings import RunSettings
from tasks.ship import metrics
from tests.support.processes import REPO, Workers, require
from tests.support.shiprun import ship, ship_settings
from transport.keys import RunKeys

# RLSHIP_CHROMIUM stands in for a machine without the browser (tests/system/test_browser_skip.py).
CHROMIUM = os.environ.get("RLSHIP_CHROMIUM", "/usr/bin/chromium")
STEPS = 2
RANKS = 2
# Per step: one task per stage, one encode and one send per rank.
PER_RANK = ("rlship.encode", "rlship.send")
PREPARE = "rlship.prepare"
# Prune and pack run in finalize's task: no task of their own (tasks/graph.py).
ONCE = tuple(f"rlship.{stage}" for stage in ("finalize", "metrics", "publish"))
# release also carries what it needs once the step's manifest is gone: ranks, replay_steps.
REPLAY_STEPS = RunSettings.model_fields["replay_steps"].default


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(what: str, check: Any, timeout: float = 30.0) -> Any:
    """Poll `check` until it returns something truthy; fail saying what never happened."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last_error, result = exc, None
        if result:
            return result
        time.sleep(0.25)
    pytest.fail(f"{what} within {timeout} s (last error: {last_error})")


def procfile_command(name: str) -> str:
    for line in (REPO / "Procfile").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {name!r} process in the Procfile")


@pytest.fixture()
def flower(redis_url: str, tmp_path: Path) -> Iterator[str]:
    """Flower started by the Procfile's own command line (the shell expands its port)."""
    port = free_port()
    log = open(tmp_path / "flower.log", "ab")  # noqa: SIM115
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "REDIS_URL": redis_url,
        "FLOWER_PORT": str(port),
        "FLOWER_UNAUTHENTICATED_API": "true",  # the test reads /api/tasks; no auth on loopback
    }
    process = subprocess.Popen(
        ["/bin/sh", "-c", f"exec {procfile_command('flower')}"],
        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"Flower answering at {url} (see {log.name})", lambda: get(f"{url}/healthcheck"))
        yield url
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def metric_samples(url: str, name: str) -> list[Any]:
    families = text_string_to_metric_families(get(f"{url}/metrics"))
    return [sample for family in families for sample in family.samples if sample.name == name]


def run_tasks(url: str, run_id: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"search": f"args:{run_id}"})
    return list(json.loads(get(f"{url}/api/tasks?{query}")).values())


def expected_tasks(run_id: str) -> set[tuple[str, tuple]]:
    expected = set()
    for step in range(STEPS):
        expected.update((name, (run_id, step)) for name in ONCE)
        expected.add(("rlship.release", (run_id, step, RANKS, REPLAY_STEPS)))
        expected.update((name, (run_id, step, rank)) for name in PER_RANK for rank in range(RANKS))
    return expected


def shown_tasks(tasks: list[dict[str, Any]]) -> set[tuple[str, tuple]]:
    """(name, args) of the stage tasks Flower saw succeed (publish may be enqueued more than
    once); the tasks before the cut (`rlship.prepare`) apart."""
    return {
        (t["name"], tuple(ast.literal_eval(t["args"])))
        for t in tasks
        if t["state"] == "SUCCESS" and t["name"] != PREPARE
    }


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1600,1000",
         "--virtual-time-budget=5000", *args],
        capture_output=True, text=True, timeout=45, check=True,
    )  # fmt: skip


class TaskRows(HTMLParser):
    """The cells' text of each row in the rendered tasks table."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.in_body = self.in_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tbody":
            self.in_body = True
        elif tag == "tr" and self.in_body:
            self.rows.append([])
        elif tag == "td" and self.in_body:
            self.in_cell = True
            self.rows[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self.in_body = False
        elif tag == "td":
            self.in_cell = False

    def handle_data(self, data: str) -> None:
        if self.in_cell:
            self.rows[-1][-1] += data


def rendered_tasks(flower: str, query: dict[str, str], profile: Path) -> list[dict[str, str]]:
    """The tasks page as Chromium renders it (its table is filled by script), row by row."""
    columns = procfile_command("flower").split("--tasks_columns=")[1].split()[0].split(",")
    page = f"{flower}/tasks?{urllib.parse.urlencode(query)}"
    parser = TaskRows()
    parser.feed(chromium("--dump-dom", page, profile=profile).stdout)
    return [dict(zip(columns, row, strict=True)) for row in parser.rows if len(row) == len(columns)]


def test_flower_shows_stage_tasks(
    flower: str, workers: Workers, redis_url: str, run_id: str, tmp_path: Path
) -> None:
    # Flower's event consumer is live once it has seen this session's workers come online.
    def workers_online() -> bool:
        online = [s for s in metric_samples(flower, "flower_worker_online") if s.value == 1.0]
        queues = (workers.cpu_queue, workers.ship_queue)
        return all(any(queue in s.labels["worker"] for s in online) for queue in queues)

    wait_for("Flower seeing this session's workers online (flower_worker_online)", workers_online)

    settings = ship_settings(run_id, redis_url, workers, tmp_path / "run", steps=STEPS, ranks=RANKS)
    assert ship(settings).summary["steps_shipped"] == STEPS
    expected = expected_tasks(run_id)

    # The API: every stage task of every shipped step, succeeded, named, keys and numbers only.
    seen: list[dict[str, Any]] = []

    def all_succeeded() -> list[dict[str, Any]] | None:
        seen[:] = run_tasks(flower, run_id)
        return seen if shown_tasks(seen) >= expected else None

    try:
        tasks = wait_for("Flower listing every stage task of the run as succeeded", all_succeeded)
    except pytest.fail.Exception:
        pytest.fail(f"Flower never showed as succeeded: {sorted(expected - shown_tasks(seen))}")
    assert shown_tasks(tasks) == expected
    # Before the cut, the rollout ids of the groups an ingest turn completed (ids, no bytes).
    assert any(t["name"] == PREPARE and t["state"] == "SUCCESS" for t in tasks)
    for task in tasks:
        if task["name"] == PREPARE:
            assert task["args"].startswith(f"('{run_id}', ['"), task["args"][:200]
            continue
        assert len(task["args"]) < 100, task["args"]
        assert task["kwargs"] in ("{}", None), task
        if task["state"] == "SUCCESS":
            assert task["runtime"] is not None and task["runtime"] >= 0, task

    # Prometheus: per-task event counters and runtime histograms.
    succeeded = {
        s.labels["task"]
        for s in metric_samples(flower, "flower_events_total")
        if s.labels.get("type") == "task-succeeded" and s.value > 0
    }
    assert succeeded >= {name for name, _ in expected}, succeeded
    runtimes = {s.labels["task"] for s in metric_samples(flower, "flower_task_runtime_seconds_count")}
    assert runtimes >= {name for name, _ in expected}, runtimes

    # A failing task (its step was never cut: nothing pruned) shows as failed, with its exception.
    absent = f"absent-{uuid.uuid4().hex[:8]}"
    redis.Redis.from_url(redis_url).set(RunKeys(absent).alive, 1, ex=60)  # a live run: not dropped
    metrics.apply_async((absent, 0), queue=workers.cpu_queue)
    failed = wait_for(
        "Flower showing the failed task",
        lambda: [t for t in run_tasks(flower, absent) if t["state"] == "FAILURE"],
    )
    assert failed[0]["name"] == "rlship.metrics" and failed[0]["exception"], failed
    assert any(
        s.labels["task"] == "rlship.metrics" and s.labels["type"] == "task-failed"
        for s in metric_samples(flower, "flower_events_total")
    )
    stray = redis.Redis.from_url(redis_url)
    if left := stray.keys(f"{RunKeys(absent).prefix}*"):  # its alive mark, the workers' count of it
        stray.delete(*left)

    # The browser: the tasks page lists every stage's tasks of every shipped step. One page
    # per stage (a page shows 15 rows), filtered to this session's workers.
    browser_missing = None if Path(CHROMIUM).exists() else f"{CHROMIUM} not found: apt-get install chromium"
    require("a headless browser (Chromium) for the tasks page", browser_missing)
    session = workers.cpu_queue.removeprefix("cpu-")
    for name in (*ONCE, *PER_RANK):
        rows = rendered_tasks(flower, {"worker": session, "name": name}, tmp_path / "chromium")
        rows = [row for row in rows if absent not in row["args"]]
        listed = {(row["name"], tuple(ast.literal_eval(row["args"]))) for row in rows}
        assert listed == {task for task in expected if task[0] == name}, rows
        assert {row["state"] for row in rows} == {"SUCCESS"}, rows
        assert all(row["runtime"].strip() for row in rows), rows
    artifacts = REPO / "artifacts"
    artifacts.mkdir(exist_ok=True)
    screenshot = artifacts / "flower-tasks.png"
    page = f"{flower}/tasks?{urllib.parse.urlencode({'worker': session})}"
    chromium(f"--screenshot={screenshot}", page, profile=tmp_path / "chromium")
    assert screenshot.stat().st_size > 10_000
    print(f"Flower tasks page screenshot: {screenshot}")
