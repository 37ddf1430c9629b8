"""The OpenTelemetry SDK side of `tasks.tracing`, imported only when tracing is on: what the
SDK decides for every process's spans, read from the standard `OTEL_*` variables (the
resource and the sampler), and the process's `TaskSpans`, which makes its spans with them
(a Celery pool process's tasks', handed to Redis on its next stage task's first read; the
orchestrator's step roots and prepare enqueues, taken by its span relay)."""

from __future__ import annotations

import os
import socket
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from tasks.task_spans import TaskSpans


class Tracing:
    """This process's tracer provider (its resource and sampler, as the SDK reads them) and
    `task_spans`, which makes the process's spans with them."""

    def __init__(self, role: str) -> None:
        attributes: dict[str, Any] = {
            "process.pid": os.getpid(),
            "host.name": socket.gethostname(),
            "rlship.role": role,
        }
        named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        )
        if not named:
            attributes["service.name"] = f"rlship-{role}"
        self.provider = TracerProvider(resource=Resource.create(attributes))
        # A pool process hands its spans on by itself; the orchestrator's relay takes its own.
        resource, sampler = self.provider.resource, self.provider.sampler
        self.task_spans = TaskSpans(resource, sampler, hand_off_idle=role == "worker")
