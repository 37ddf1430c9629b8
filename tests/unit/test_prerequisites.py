"""The one rule for a test's missing prerequisite: a failure naming it under CI=true, a
skip saying why elsewhere, never a silent skip."""

from __future__ import annotations

import pytest

from tests.support.processes import require, require_module

OUTCOMES = (pytest.fail.Exception, pytest.skip.Exception)


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_missing_prerequisite_fails_in_ci_naming_it(ci, monkeypatch):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(OUTCOMES) as outcome:
        require("Chromium", "/usr/bin/chromium not found")
    assert outcome.type is pytest.fail.Exception
    assert "needs Chromium: /usr/bin/chromium not found" in str(outcome.value) and "CI=true" in str(
        outcome.value
    )
    with pytest.raises(OUTCOMES) as outcome:
        require_module("no_such_package_x")
    assert outcome.type is pytest.fail.Exception
    assert "needs the Python package 'no_such_package_x'" in str(outcome.value)


def test_a_missing_prerequisite_skips_elsewhere_saying_why(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(OUTCOMES) as outcome:
        require("root", "not root")
    assert outcome.type is pytest.skip.Exception and "needs root: not root" in str(outcome.value)


def test_a_present_prerequisite_changes_nothing(monkeypatch):
    monkeypatch.setenv("CI", "true")
    require("root", None)
    assert require_module("json").dumps([]) == "[]"
