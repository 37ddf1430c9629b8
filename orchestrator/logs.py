"""Logging of the `rlship` commands, set up in one place: plain text, or JSON lines with
`--log-json` (the workers' format, `tasks.logs.JsonFormatter`). Every line carries the
process's own context (run id, and a trainer's rank), so lines of the many processes of a
run can be joined and filtered."""

from __future__ import annotations

import logging
from typing import Any

from tasks.logs import JsonFormatter, MaskingFormatter

PLAIN_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class StaticContext(logging.Filter):
    """Adds fixed fields to every record; a field the call passed in `extra` wins."""

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in self.fields.items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


def configure_logging(log_json: bool, level: int, **context: Any) -> None:
    """One stderr handler on the root logger (if it has none yet, as `basicConfig`)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_json else MaskingFormatter(logging.Formatter(PLAIN_FORMAT)))
    handler.addFilter(StaticContext(context))
    logging.basicConfig(level=level, handlers=[handler])
