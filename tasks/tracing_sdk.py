"""The OpenTelemetry SDK side of `tasks.tracing`, imported only when tracing is on: a
process's tracer provider (resource, sampler and exporter from the standard `OTEL_*`
variables) and the span processor of Celery pool processes."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, Tracer, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from tasks.tracing import TASK_END_EXPORT_WAIT_SECONDS, protocol

log = logging.getLogger("rlship.tracing")

QUEUED_SPANS_MAX = 4096


class TaskEndExport(SpanProcessor):
    """A span processor for Celery pool processes: ended spans wait here and are handed to
    an export thread at the end of each task (`flush`), which waits until they are sent.
    A batch processor on a timer would keep a task's spans for seconds, and a pool process
    killed meanwhile (OOM, a fault) would take its earlier, finished tasks' spans with it."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter
        self._spans: list[ReadableSpan] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._exported = threading.Event()
        self._exported.set()
        self._answering = True  # the collector took the last export
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="rlship-span-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            if len(self._spans) < QUEUED_SPANS_MAX:
                self._spans.append(span)

    def flush(self, wait: float) -> bool:
        """Hand the ended spans to the export thread; wait up to `wait` seconds for them to
        be sent. An export still under way (a collector that does not answer: the exporter
        retries for OTEL_EXPORTER_OTLP_TIMEOUT) keeps them queued for the next hand-off,
        and while the collector's last answer was a failure no task waits for it."""
        if not self._spans:  # nothing recorded (a step not sampled)
            return True
        if not self._exported.is_set():
            return False
        self._exported.clear()
        self._wake.set()
        return self._exported.wait(wait if self._answering else 0.0)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                spans, self._spans = self._spans, []
            try:
                if spans:
                    self._answering = self._exporter.export(spans) == SpanExportResult.SUCCESS
            except Exception:  # an exporter's error must never reach a task
                self._answering = False
                log.exception("exporting %d spans failed", len(spans))
            finally:
                self._exported.set()

    def shutdown(self) -> None:
        self.flush(TASK_END_EXPORT_WAIT_SECONDS)
        self._stopped = True
        self._wake.set()
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.flush(timeout_millis / 1000)


def _exporter() -> SpanExporter:
    if protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


class Tracing:
    """This process's tracer provider, its tracer and, in a Celery pool process, the
    processor flushed at each task's end; unless the operator set `OTEL_BSP_SCHEDULE_DELAY`:
    then it batches on that timer as the SDK's batch processor does (one request a delay
    instead of one a task, and a killed pool process loses the spans it had not sent)."""

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
        self.task_end: TaskEndExport | None = None
        if role == "worker" and not os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "").strip():
            self.task_end = TaskEndExport(_exporter())
            self.provider.add_span_processor(self.task_end)
        else:
            self.provider.add_span_processor(BatchSpanProcessor(_exporter()))
        self.tracer: Tracer = self.provider.get_tracer("rlship")
