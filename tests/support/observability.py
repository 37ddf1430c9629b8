"""The repository's Prometheus rules and Grafana board as tests read them (ops/), and a real
`prometheus` server a test starts on a free port: the alert expressions, the board's queries
with its template variables filled in, and both with their time windows shortened for a short
run."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.processes import REPO, free_port, require

RULES = REPO / "ops" / "prometheus" / "rlship-alerts.yml"
RULE_TESTS = REPO / "ops" / "prometheus" / "tests"
BOARD = REPO / "ops" / "grafana" / "dashboards" / "rlship-step.json"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"

# A range selector's or subquery's window (`[5m]`, `[1h30m]`, `[$__rate_interval]`).
_WINDOW = re.compile(r"\[(?:\$__\w+|\$\{__\w+\}|(?:\d+(?:ms|[smhdwy]))+)(?P<step>:[^\]]*)?\]")


def promtool() -> str:
    """The path of `promtool` (Debian's package `prometheus`), or `require`'s verdict."""
    found = shutil.which("promtool")
    require("promtool (Debian package prometheus; .ci/run installs it)", None if found else "not on PATH")
    assert found
    return found


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of the rules file, in file order."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def board() -> dict[str, Any]:
    return json.loads(BOARD.read_text())


def board_panels() -> list[dict[str, Any]]:
    """Every panel of the board, those inside rows included."""
    panels = []
    for panel in board()["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def board_queries(exemplars: bool = False) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every Prometheus query of every panel (with `exemplars`,
    those that ask for exemplars)."""
    return [
        (panel["title"], target["expr"])
        for panel in board_panels()
        for target in panel.get("targets", [])
        if "expr" in target and (target.get("exemplar") or not exemplars)
    ]


def fill_variables(expr: str, variables: dict[str, str]) -> str:
    """Grafana's `$name` and `${name}` replaced by the values given (the run's id, ...)."""
    for name, value in variables.items():
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return expr


def shorten_windows(expr: str, window: str) -> str:
    """Every range window (`[5m]`, `[$__rate_interval]`) set to `window`: what a rate or an
    `_over_time` reads in a run of seconds, from scrapes a second apart."""
    return _WINDOW.sub(lambda match: f"[{window}{match['step'] or ''}]", expr)


def github_anchor(heading: str) -> str:
    """The anchor a Markdown heading gets on GitHub: lower case, punctuation but `-` and `_`
    dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {github_anchor(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


@dataclass
class Prometheus:
    """A running `prometheus` and its HTTP API."""

    url: str

    def api(self, path: str, **params: str | float) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        """The instant vector (or scalar) `expr` evaluates to at time `at`."""
        data = self.api("query", query=expr, time=at)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]


@contextlib.contextmanager
def running_prometheus(config: dict[str, Any], directory: Path) -> Iterator[Prometheus]:
    """`prometheus` with `config` (its rule files, given as paths, copied beside it) on a free
    loopback port, its data in `directory`; stopped by PID."""
    binary = shutil.which("prometheus")
    require("prometheus (Debian package prometheus; .ci/run installs it)", None if binary else "not on PATH")
    assert binary
    config_path = directory / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    server = Prometheus(f"http://127.0.0.1:{port}")
    with open(directory / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2):
                    break
            except OSError:
                assert process.poll() is None, (directory / "prometheus.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "prometheus not ready in 30 s"
                time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        process.wait(20)
