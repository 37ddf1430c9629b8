"""The OpenTelemetry SDK side of `tasks.tracing`, imported only when tracing is on: a
process's tracer provider (resource, sampler and exporter from the standard `OTEL_*`
variables). The orchestrator's spans (a step's root, the prepare enqueues) are the SDK's,
exported in batches by its batch processor; a Celery pool process's are `TaskSpans`, made
with the provider's resource and sampler and handed to Redis on the process's next stage
task's first read."""

from __future__ import annotations

import os
import socket
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Tracer, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from tasks.task_spans import TaskSpans
from tasks.tracing import protocol


def _exporter() -> SpanExporter:
    if protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


class Tracing:
    """This process's tracer provider and its tracer, exporting on the SDK's batch
    processor (not in a Celery pool process, `role` "worker"), and `task_spans`, which
    makes the tasks' spans with the provider's resource and sampler."""

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
        self.task_spans = TaskSpans(self.provider.resource, self.provider.sampler)
        if role != "worker":
            self.provider.add_span_processor(BatchSpanProcessor(_exporter()))
        self.tracer: Tracer = self.provider.get_tracer("rlship")
