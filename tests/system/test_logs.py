"""Structured logs: the JSON line format (fields, extras, tracebacks, passwords masked), the
commands' logging setup with `--log-json`, and a real Celery worker logging JSON lines that
carry the failing task's run id and step."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from orchestrator.logs import StaticContext
from orchestrator.settings import RunSettings, env_name, settings_to_env
from tasks.logs import LOG_JSON_ENV, JsonFormatter, log_json_enabled, mask_secrets
from tests.support.processes import REPO, running_workers


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    entry = logging.LogRecord("rlship.test", logging.WARNING, __file__, 1, message, args, None)
    entry.__dict__.update(extra)
    return entry


def test_json_line_fields_and_extras() -> None:
    line = JsonFormatter().format(record("step %d: %s", 3, "late", step=3, rank=1, run_id="r1"))
    entry = json.loads(line)
    assert "\n" not in line
    assert entry["level"] == "WARNING" and entry["logger"] == "rlship.test"
    assert entry["message"] == "step 3: late"
    assert (entry["step"], entry["rank"], entry["run_id"]) == (3, 1, "r1")
    assert entry["time"].endswith("+00:00") and isinstance(entry["pid"], int)
    assert not {"msg", "args", "levelno", "pathname"} & set(entry)


def test_json_line_traceback_and_unserializable_extra() -> None:
    try:
        raise ValueError("bad value")
    except ValueError:
        entry = record("failed", path=Path("/tmp/x"))
        entry.exc_info = sys.exc_info()
    parsed = json.loads(JsonFormatter().format(entry))
    assert "ValueError: bad value" in parsed["exc"] and parsed["path"] == "/tmp/x"


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("Cannot connect to redis://:s3cret@host:6379/0: refused",
         "Cannot connect to redis://:***@host:6379/0: refused"),
        ("rediss://user:p%40ss@h/1 and redis://h/2", "rediss://user:***@h/1 and redis://h/2"),
        ("redis://h:6379/0?password=s3cret&db=1", "redis://h:6379/0?password=***&db=1"),
        ("no secret in redis://host:6379/0", "no secret in redis://host:6379/0"),
    ],
)  # fmt: skip
def test_mask_secrets(text: str, masked: str) -> None:
    assert mask_secrets(text) == masked
    assert "s3cret" not in JsonFormatter().format(record("%s", text, url=text))


def test_static_context_does_not_override_extra() -> None:
    context = StaticContext({"run_id": "r1", "rank": 0})
    entry = record("x", rank=5)
    assert context.filter(entry)
    assert (entry.run_id, entry.rank) == ("r1", 5)


def test_log_json_setting_reaches_the_workers() -> None:
    """The workers read the setting from the environment the run gives its children."""
    assert env_name("log_json") == LOG_JSON_ENV
    env = settings_to_env(RunSettings(log_json=True))
    assert env[LOG_JSON_ENV] == "True"
    for value, enabled in (("True", True), ("1", True), ("False", False), ("", False)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(LOG_JSON_ENV, value)
            assert log_json_enabled() is enabled


def test_command_logging_setup() -> None:
    """As `rlship trainer --log-json` sets it up: JSON lines on stderr with the process's
    run id and rank; plain text without the flag."""
    script = (
        "import logging, sys; from orchestrator.logs import configure_logging; "
        "configure_logging(sys.argv[1] == 'json', logging.INFO, run_id='r1', rank=1); "
        "logging.getLogger('rlship.trainer').info('received step %d', 4, extra={'step': 4}); "
        "logging.getLogger('rlship.trainer').debug('not shown')"
    )
    json_run = subprocess.run(
        [sys.executable, "-c", script, "json"], cwd=REPO, capture_output=True, text=True, check=True
    )
    lines = json_run.stderr.splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["message"] == "received step 4" and entry["logger"] == "rlship.trainer"
    assert (entry["run_id"], entry["rank"], entry["step"], entry["level"]) == ("r1", 1, 4, "INFO")
    plain = subprocess.run(
        [sys.executable, "-c", script, "plain"], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert plain.stderr.rstrip().endswith("rlship.trainer INFO received step 4")


@pytest.mark.timeout(120)
def test_celery_worker_logs_json_with_the_task_context(redis_url: str, run_id: str, tmp_path: Path) -> None:
    """A task that fails (its step was never cut: metrics finds nothing pruned) is logged
    by the worker as one JSON line naming the task, its Celery id (as Flower and `celery
    inspect` know it), its run id and step."""
    from tasks.ship import metrics
    from transport.keys import RunKeys

    with running_workers(redis_url, tmp_path, env={LOG_JSON_ENV: "1"}) as workers:
        redis.Redis.from_url(redis_url).set(RunKeys(run_id).alive, 1, ex=60)  # a live run: not dropped
        sent = metrics.apply_async((run_id, 7), queue=workers.cpu_queue)
        deadline = time.monotonic() + 60
        failures: list[dict] = []
        while not failures and time.monotonic() < deadline:
            time.sleep(0.2)
            text = "".join(path.read_text() for path in tmp_path.glob("cpu-*.log"))
            entries = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
            failures = [e for e in entries if e.get("task") == "rlship.metrics" and e["level"] == "ERROR"]
    assert failures, text
    assert (failures[0]["run_id"], failures[0]["step"]) == (run_id, 7)
    assert failures[0]["task_id"] == sent.id
    assert "rank" not in failures[0] and failures[0]["logger"].startswith("celery")
