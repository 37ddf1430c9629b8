"""The README's test command on a machine without Chromium: the Flower test skips its
browser part and says why, instead of failing (outside CI; `.ci/run` installs Chromium)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.processes import REPO


@pytest.mark.timeout(400)
def test_the_flower_test_skips_its_browser_part_without_chromium(redis_url):
    env = {key: value for key, value in os.environ.items() if key != "CI"}
    env.update({"RLSHIP_CHROMIUM": "/nonexistent/chromium", "REDIS_URL": redis_url})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "tests/system/test_flower.py"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 skipped" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]
    reason = "needs a headless browser (Chromium) for the tasks page: /nonexistent/chromium not found"
    assert reason in done.stdout, done.stdout[-3000:]
