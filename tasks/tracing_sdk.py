"""The OpenTelemetry SDK side of `tasks.tracing`, imported only when tracing is on: a
process's tracer provider (resource, sampler and exporter from the standard `OTEL_*`
variables) and the span processors of Celery pool processes: `TaskEndPush` (OTLP over
HTTP: each task's spans into the run's span list in Redis, relayed by the orchestrator) and
`TaskEndExport` (gRPC: each task's spans exported by the pool process itself)."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from opentelemetry.context import Context

# The exporter's own encoders of one span, a resource and a scope (what its public
# `encode_spans` is made of), so that a process encodes its resource and scope once.
from opentelemetry.exporter.otlp.proto.common._internal import _encode_instrumentation_scope, _encode_resource
from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import _encode_span
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, Tracer, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from tasks.tracing import hold_spans, protocol

log = logging.getLogger("rlship.tracing")

QUEUED_SPANS_MAX = 4096
# How long a task's end waits for its spans to reach the collector: a collector that does
# not answer delays one task by this, then none until it answers again (`TaskEndExport.flush`).
TASK_END_EXPORT_WAIT_SECONDS = 2.0


class SpansEncoder:
    """Spans to one OTLP `ExportTraceServiceRequest`, as the exporter's `encode_spans` makes
    it (spans grouped by resource, then by scope, in their order), with each resource and
    scope encoded once: a pool process's spans all share its provider's resource and the
    rlship tracer's scope, and encoding them again for every task's hand-off (the resource's
    attributes, its hash made of their JSON) was a third of what the hand-off cost."""

    def __init__(self) -> None:
        self._encoded: dict[int, tuple[Any, Any]] = {}  # id(resource or scope) -> (it, encoded)

    def _once(self, value: Any, encode: Any) -> Any:
        held = self._encoded.get(id(value))
        if held is None or held[0] is not value:
            held = self._encoded[id(value)] = (value, encode(value))
        return held[1]

    def request(self, spans: list[ReadableSpan]) -> bytes:
        grouped: dict[int, tuple[Resource, dict[int, tuple[Any, list[Any]]]]] = {}
        for span in spans:
            resource, scope = span.resource, span.instrumentation_scope
            _, scopes = grouped.setdefault(id(resource), (resource, {}))
            scopes.setdefault(id(scope), (scope, []))[1].append(_encode_span(span))
        resource_spans = [
            ResourceSpans(
                resource=self._once(resource, _encode_resource),
                scope_spans=[
                    ScopeSpans(
                        scope=self._once(scope, _encode_instrumentation_scope),
                        spans=encoded,
                        schema_url=scope.schema_url if scope else None,
                    )
                    for scope, encoded in scopes.values()
                ],
                schema_url=resource.schema_url,
            )
            for resource, scopes in grouped.values()
        ]
        return ExportTraceServiceRequest(resource_spans=resource_spans).SerializeToString()


class TaskEndSpans(SpanProcessor):
    """What a Celery pool process's span processor holds between two task ends: the spans
    ended since the last hand-off (at most `QUEUED_SPANS_MAX`), taken by `task_ended` (a
    stage task's end) and `process_exit` (the process stops)."""

    def __init__(self) -> None:
        self._spans: list[ReadableSpan] = []
        self._lock = threading.Lock()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            if len(self._spans) < QUEUED_SPANS_MAX:
                self._spans.append(span)

    def _take(self) -> list[ReadableSpan]:
        """The spans held, and none held after."""
        with self._lock:
            spans, self._spans = self._spans, []
        return spans

    def _give_back(self, spans: list[ReadableSpan]) -> None:
        """Spans taken and not handed on: held again, ahead of those ended since, to the cap."""
        with self._lock:
            self._spans[:0] = spans[: max(0, QUEUED_SPANS_MAX - len(self._spans))]

    def task_ended(self, run_id: str) -> None:
        """A stage task of run `run_id` ended: hand its spans on."""
        raise NotImplementedError

    def process_exit(self) -> None:
        """The process stops: hand on what is still held."""
        raise NotImplementedError


class TaskEndPush(TaskEndSpans):
    """A span processor for Celery pool processes (OTLP over HTTP): at the end of each
    stage task its ended spans are encoded as one OTLP `ExportTraceServiceRequest` and
    pushed onto the run's span list in Redis (`tasks.tracing.hold_spans`: one script), whence
    the orchestrator relays them (`orchestrator.span_relay`). They are out of the process
    before its next task starts, as with `TaskEndExport`, for an encode and one Redis round
    trip instead of an HTTP request. Redis not answering keeps them here for the next push."""

    def __init__(self) -> None:
        super().__init__()
        self._run_id: str | None = None  # of the last push: where spans left at exit go
        self._failing = False
        self._encoder = SpansEncoder()

    def task_ended(self, run_id: str) -> None:
        """Push the ended spans onto run `run_id`'s span list."""
        from tasks.context import redis_client

        self._run_id = run_id
        spans = self._take()
        if not spans:  # nothing recorded (a step not sampled)
            return
        try:
            hold_spans(redis_client(), run_id, [self._encoder.request(spans)])
        except Exception:  # a push's error must never reach a task: the spans wait here
            if not self._failing:
                log.exception("pushing %d spans to Redis failed; they wait for the next push", len(spans))
            self._failing = True
            self._give_back(spans)
            return
        self._failing = False

    def process_exit(self) -> None:
        """The process stops: what is still here (prepare spans) goes to the last run's list."""
        if self._run_id is not None:
            self.task_ended(self._run_id)

    def shutdown(self) -> None:
        self.process_exit()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.process_exit()
        return True


class TaskEndExport(TaskEndSpans):
    """A span processor for Celery pool processes: ended spans wait here and are handed to
    an export thread at the end of each task (`flush`), which waits until they are sent.
    A batch processor on a timer would keep a task's spans for seconds, and a pool process
    killed meanwhile (OOM, a fault) would take its earlier, finished tasks' spans with it."""

    def __init__(self, exporter: SpanExporter) -> None:
        super().__init__()
        self._exporter = exporter
        self._wake = threading.Event()
        self._exported = threading.Event()
        self._exported.set()
        self._answering = True  # the collector took the last export
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="rlship-span-export", daemon=True)
        self._thread.start()

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
            spans = self._take()
            try:
                if spans:
                    self._answering = self._exporter.export(spans) == SpanExportResult.SUCCESS
            except Exception:  # an exporter's error must never reach a task
                self._answering = False
                log.exception("exporting %d spans failed", len(spans))
            finally:
                self._exported.set()

    def task_ended(self, run_id: str) -> None:
        self.flush(TASK_END_EXPORT_WAIT_SECONDS)

    def process_exit(self) -> None:
        self.flush(TASK_END_EXPORT_WAIT_SECONDS)

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
    processor called at each task's end (`task_end`: `TaskEndPush`, or `TaskEndExport` for
    gRPC); unless the operator set `OTEL_BSP_SCHEDULE_DELAY`: then it batches on that timer
    as the SDK's batch processor does (one request a delay, and a killed pool process loses
    the spans it had not sent). `task_end` chooses for the bench: `push`, `export`, or None
    for the batch processor."""

    def __init__(self, role: str, task_end: str | None = "default") -> None:
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
        if task_end == "default":
            timer = os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "").strip()
            task_end = None if role != "worker" or timer else "export" if protocol() == "grpc" else "push"
        self.task_end: TaskEndSpans | None = None
        if task_end is not None:
            self.task_end = TaskEndPush() if task_end == "push" else TaskEndExport(_exporter())
            self.provider.add_span_processor(self.task_end)
        else:
            self.provider.add_span_processor(BatchSpanProcessor(_exporter()))
        self.tracer: Tracer = self.provider.get_tracer("rlship")
