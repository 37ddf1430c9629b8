"""ops/prometheus/rlship-alerts.yml as Prometheus' own tool reads it: `promtool check rules`
accepts it, `promtool test rules` passes its unit tests (each alert fires on its series and
stays silent on healthy ones), every alert is made to fire by some test and is checked on the
healthy run, and every alert names a runbook that exists in docs/troubleshooting.md."""

from __future__ import annotations

import subprocess

import yaml

from tests.support.observability import RULE_TESTS, RULES, TROUBLESHOOTING, alert_rules, anchors, promtool


def test_promtool_checks_the_rules() -> None:
    checked = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in checked.stdout, checked.stdout


def test_promtool_runs_the_rule_unit_tests() -> None:
    files = sorted(RULE_TESTS.glob("*.yml"))
    assert files
    tested = subprocess.run(
        [promtool(), "test", "rules", *map(str, files)],
        capture_output=True, text=True, timeout=120, cwd=RULE_TESTS,
    )  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "FAILED" not in tested.stdout and tested.stdout.count("SUCCESS") == len(files), tested.stdout


def test_every_alert_fires_in_a_test_and_is_silent_on_the_healthy_run() -> None:
    """A rule nothing makes fire could be broken unseen (a metric misnamed makes it silent)."""
    fired, silent_on_healthy = set(), set()
    for path in RULE_TESTS.glob("*.yml"):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                if case.get("exp_alerts"):
                    fired.add(case["alertname"])
                elif test["name"] == "healthy run":
                    silent_on_healthy.add(case["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert names - fired == set(), "alerts no test makes fire"
    assert names - silent_on_healthy == set(), "alerts not checked on the healthy run"


def test_every_alert_names_its_runbook_and_severity() -> None:
    sections = anchors(TROUBLESHOOTING)
    for rule in alert_rules():
        name, annotations = rule["alert"], rule["annotations"]
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description", "runbook_url"} <= set(annotations), name
        page, anchor = annotations["runbook_url"].split("#")
        assert page == "docs/troubleshooting.md", name
        assert anchor in sections, f"{name}: docs/troubleshooting.md has no section #{anchor}"
        assert "run_id" in annotations["summary"], f"{name}: the summary should name the run"
