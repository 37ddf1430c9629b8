"""Log lines of every rlship process in one format: plain text, or JSON lines (the
`log_json` setting; workers read `RLSHIP_LOG_JSON`) with the run id, step and rank of what
is being done, so the lines of a run's many processes can be joined and filtered. Defined
here, below both the workers and the `rlship` commands, so that both share it."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from celery import current_task, signals

from tasks.tracing import current_trace_id

LOG_JSON_ENV = "RLSHIP_LOG_JSON"  # the `log_json` setting, as the workers read it


# Attributes every LogRecord has; any other attribute is an extra field worth logging.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName",
}  # fmt: skip
# Up to the last @ of the URL: a password may hold an unescaped @ (as `urlsplit` reads it).
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^\s\"']+@", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"(\bpassword=)[^&\s]+", re.IGNORECASE)


def mask_secrets(text: str) -> str:
    """Passwords in URLs (`redis://user:secret@host`, `?password=secret`) replaced by ***: a
    connection error quotes the URL it failed on. The one masking of every rlship output."""
    return _QUERY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


class MaskingFormatter(logging.Formatter):
    """Another formatter's lines (plain text: Celery's, or `%(message)s`), passwords masked."""

    def __init__(self, inner: logging.Formatter | None = None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(self.inner.format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC), level, logger, message, pid, then every extra
    field (run_id, step, rank, task, task_id, ...) and the traceback, if any; passwords masked."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        entry.update((k, v) for k, v in vars(record).items() if k not in _RECORD_FIELDS)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return mask_secrets(json.dumps(entry, default=str))


CONTEXT_ARGUMENTS = ("run_id", "step", "rank")


@functools.cache
def _parameters(run: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(run).parameters)


class TaskContext(logging.Filter):
    """Adds the running task's name, its Celery id (`task_id`: Flower's page of the task is
    /task/{task_id}), its run_id, step and rank arguments (the ones it takes) and, when
    tracing is on, its step's `trace_id` to each record logged while it runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        task = current_task
        if task and task.request.id:
            record.task = task.name
            record.task_id = task.request.id
            arguments = dict(zip(_parameters(task.run), task.request.args or (), strict=False))
            for name in CONTEXT_ARGUMENTS:
                if name in arguments and not hasattr(record, name):
                    setattr(record, name, arguments[name])
            trace_id = current_trace_id()
            if trace_id is not None:
                record.trace_id = trace_id
        return True


def log_json_enabled() -> bool:
    return os.environ.get(LOG_JSON_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _worker_log_format(logger: logging.Logger, **_: Any) -> None:
    """Keep Celery's logging setup (level, handlers), with JSON lines when asked for, and
    passwords masked either way."""
    for handler in logger.handlers:
        if log_json_enabled():
            handler.setFormatter(JsonFormatter())
            handler.addFilter(TaskContext())
        elif not isinstance(handler.formatter, MaskingFormatter):
            handler.setFormatter(MaskingFormatter(handler.formatter))
