"""The one rule for a test's missing prerequisite: a failure naming it under CI=true, a
skip saying why elsewhere, never a silent skip."""

from __future__ import annotations

import pytest

from tests.conftest import require, require_module


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_missing_prerequisite_fails_in_ci_naming_it(ci, monkeypatch):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"needs Chromium: /usr/bin/chromium not found .*CI=true"):
        require("Chromium", "/usr/bin/chromium not found")
    with pytest.raises(pytest.fail.Exception, match=r"needs the Python package 'no_such_package_x'"):
        require_module("no_such_package_x")


def test_a_missing_prerequisite_skips_elsewhere_saying_why(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"needs root: not root"):
        require("root", "not root")


def test_a_present_prerequisite_changes_nothing(monkeypatch):
    monkeypatch.setenv("CI", "true")
    require("root", None)
    assert require_module("json").dumps([]) == "[]"
