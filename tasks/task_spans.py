"""The spans of a Celery pool process's tasks (`tasks.tracing` makes them at a task's start
and end and around a rank's send), and the orchestrator's (its step roots and prepare
enqueues, `orchestrator.step_traces`): recorded as small plain objects and written as OTLP's
protobuf bytes as each ends (`tasks.otlp_wire`), not made by the OpenTelemetry SDK. A pool
process hands them to the run's span list in Redis on the pipeline of its next stage task's
first read (`TaskSpans.ride`), whence the orchestrator relays them to the collector
(`orchestrator.span_relay`), with its own.

Why not the SDK's spans: a pool process makes two spans a task, thousands a minute, and the
SDK's span objects (their bounded attributes and locks, the processors' hooks, the
exporter's encoder going over every field again) cost 0.3 ms a task back to back and about
1 ms a task after a stage's numpy work has filled the caches, 4.7% of a default step's CPU
(BENCHMARKS.md, Tracing). What the SDK decides is still the SDK's: its sampler (from
`OTEL_TRACES_SAMPLER`, asked for every span as the SDK asks it) and its resource
(`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`); the ids are random as its default id
generator's; the encoding is the exporter's (the test holds the two to each other). A task's
spans carry no events, links or trace state, and at most a dozen attributes.

Why riding: a push of its own was a Redis round trip a task, most of what a task's spans
cost its process (0.16 of 0.2 ms, BENCHMARKS.md). A task's spans are out of the process
once its next stage task has made its first read, before any of that task's work, or, with
no task coming, `FLUSH_SECONDS` after they ended (a daemon thread pushes them); so a pool
process killed later (OOM, a fault) loses only the spans of the task it was running and
of the last one before an idle moment. Redis not answering keeps them here for the next
hand-off.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.proto.trace.v1.trace_pb2 import Span, SpanFlags
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import Sampler

from tasks import otlp_wire
from tasks.tracing import dropped_spans, format_traceparent, queue_spans

log = logging.getLogger("rlship.tracing")

SCOPE = "rlship"  # the instrumentation scope, as the orchestrator's tracer names it
QUEUED_SPANS_MAX = 4096  # spans held between two hand-offs (Redis not answering), the newest dropped
FLUSH_SECONDS = 0.5  # spans held this long with no stage task's first read to ride on are pushed
# OTLP's kinds (opentelemetry.proto.trace.v1.Span.SpanKind) of the API's
_KIND = {
    trace.SpanKind.INTERNAL: Span.SPAN_KIND_INTERNAL,
    trace.SpanKind.CONSUMER: Span.SPAN_KIND_CONSUMER,
    trace.SpanKind.PRODUCER: Span.SPAN_KIND_PRODUCER,
}
# The span's flags as the exporter sets them: whether its parent is remote is known.
_FLAGS_LOCAL = SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_FLAGS_REMOTE = _FLAGS_LOCAL | SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_SAMPLED = trace.TraceFlags(trace.TraceFlags.SAMPLED)


@dataclass(slots=True)
class TaskSpan:
    """A span of a task while it is open: what it ends as and what its children and the
    messages it enqueues carry (`traceparent`). Unsampled, it records nothing but is still
    the parent its children and successors inherit the decision from."""

    name: str
    trace_id: int
    span_id: int
    parent_id: int  # 0: the trace's root
    parent_remote: bool
    sampled: bool
    kind: int  # OTLP's
    start_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    links: tuple[tuple[int, int], ...] = ()  # (trace id, span id) of spans of this process

    @property
    def traceparent(self) -> str:
        return format_traceparent(self.trace_id, self.span_id, int(self.sampled))


class TaskSpans:
    """This process's spans: `start` and `end` a task's, `child` around a part of it,
    `current` the one open innermost in this thread (what an enqueued message carries),
    `ride` what ended on a stage task's first read to a run's span list (else a flusher
    thread `push`es it, unless `hand_off_idle` is off: the orchestrator's relay `take`s
    them); `open` and `close` a span never current (the orchestrator's)."""

    def __init__(self, resource: Resource, sampler: Sampler, *, hand_off_idle: bool = True) -> None:
        self._sampler = sampler
        self._hand_off_idle = hand_off_idle  # False: taken by the process's relay (`take`)
        self._resource = otlp_wire.resource(resource.attributes)
        self._resource_schema = resource.schema_url
        self._scope = otlp_wire.scope(SCOPE)
        self._current: contextvars.ContextVar[TaskSpan | None] = contextvars.ContextVar(
            "rlship_task_span", default=None
        )
        self._ended: list[bytes] = []  # each an encoded `Span`
        self._held_since: float | None = None  # when the oldest of `_ended` ended (monotonic)
        self._lock = threading.Lock()
        self._run_id: str | None = None  # of the last task served: where the flusher pushes
        self._failing = False
        self._flusher: threading.Thread | None = None

    def serving(self, run_id: str | None) -> None:
        """A task of run `run_id` starts here: spans the flusher pushes go to its list."""
        if run_id:
            self._run_id = run_id

    def current(self) -> TaskSpan | None:
        return self._current.get()

    def open(
        self,
        name: str,
        attributes: dict[str, Any],
        *,
        parent: tuple[int, int, int] | TaskSpan | None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        links: tuple[tuple[int, int], ...] = (),
    ) -> TaskSpan:
        """A span, child of `parent`: a remote one ((trace id, span id, trace flags) of a
        message's `traceparent`), a span of this process, or none (the root of a new trace),
        linked to `links` (sampled spans of this process). The sampler decides as the SDK's
        tracer would ask it."""
        if isinstance(parent, TaskSpan):
            trace_id, parent_id, flags, remote = parent.trace_id, parent.span_id, int(parent.sampled), False
        elif parent is not None:
            (trace_id, parent_id, flags), remote = parent, True
        else:
            trace_id, parent_id, flags, remote = random.getrandbits(128) or 1, 0, 0, False
        parent_context = None
        if parent_id:
            parent_span = trace.NonRecordingSpan(
                trace.SpanContext(trace_id, parent_id, is_remote=remote, trace_flags=trace.TraceFlags(flags))
            )
            parent_context = trace.set_span_in_context(parent_span)
        sdk_links = [
            trace.Link(trace.SpanContext(*link, is_remote=False, trace_flags=_SAMPLED)) for link in links
        ]
        decision = self._sampler.should_sample(parent_context, trace_id, name, kind, attributes, sdk_links)
        sampled = decision.decision.is_sampled()
        return TaskSpan(
            name=name,
            trace_id=trace_id,
            span_id=random.getrandbits(64) or 1,
            parent_id=parent_id,
            parent_remote=remote,
            sampled=sampled,
            kind=_KIND[kind],
            start_ns=time.time_ns(),
            attributes=dict(decision.attributes) if sampled else {},
            links=links,
        )

    def start(
        self,
        name: str,
        attributes: dict[str, Any],
        *,
        parent: tuple[int, int, int] | TaskSpan | None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    ) -> tuple[TaskSpan, contextvars.Token[Any]]:
        """`open`, the span current from now on in this thread; with the token that `end`
        takes back."""
        span = self.open(name, attributes, parent=parent, kind=kind)
        return span, self._current.set(span)

    def end(self, span: TaskSpan, token: contextvars.Token[Any], error: str | None = None) -> None:
        """The span ends now (`close`) and is no longer current."""
        self._current.reset(token)
        self.close(span, error)

    def close(self, span: TaskSpan, error: str | None = None) -> None:
        """The span ends now (with an error status if `error`) and, sampled, waits in its
        OTLP form to be handed on."""
        end_ns = time.time_ns()
        if not span.sampled:
            return
        encoded = otlp_wire.span(
            trace_id=span.trace_id,
            span_id=span.span_id,
            parent_id=span.parent_id,
            name=span.name,
            kind=span.kind,
            start_ns=span.start_ns,
            end_ns=end_ns,
            attributes=span.attributes,
            links=span.links,
            error=error,
            flags=_FLAGS_REMOTE if span.parent_remote else _FLAGS_LOCAL,
        )
        with self._lock:
            if len(self._ended) < QUEUED_SPANS_MAX:
                self._ended.append(encoded)
            if self._held_since is None:
                self._held_since = time.monotonic()
        if self._hand_off_idle and self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_idle, name="rlship-span-flusher", daemon=True)
            self._flusher.start()

    def ended_child(
        self, name: str, attributes: dict[str, Any], seconds: float, error: str | None = None
    ) -> None:
        """A span of a part of the current one that took `seconds` and ends now (with an
        error status if `error`): parts that overlap (the sends of several ranks, side by
        side) are siblings, where `child` would nest each in the one open before it."""
        span = self.open(name, attributes, parent=self.current())
        span.start_ns -= int(seconds * 1e9)
        self.close(span, error)

    @contextlib.contextmanager
    def child(self, name: str, attributes: dict[str, Any]) -> Iterator[None]:
        """A span around a part of the current one (a rank's send, a carried stage)."""
        span, token = self.start(name, attributes, parent=self.current())
        try:
            yield
        except BaseException as raised:  # as the SDK's spans end: the error's type and text
            self.end(span, token, error=f"{type(raised).__name__}: {raised}"[:200])
            raise
        self.end(span, token)

    def request(self, spans: list[bytes]) -> bytes:
        """Encoded `spans` as one serialized OTLP `ExportTraceServiceRequest` of this process."""
        return otlp_wire.export_request(self._resource, self._scope, spans, self._resource_schema)

    def take(self) -> list[bytes]:
        """The spans ended since the last take, each an encoded `Span`, and none held after."""
        with self._lock:
            spans, self._ended, self._held_since = self._ended, [], None
        return spans

    def give_back(self, spans: list[bytes]) -> None:
        """Spans that did not leave (Redis not answering) wait, before any ended since."""
        with self._lock:
            self._ended[:0] = spans[: max(0, QUEUED_SPANS_MAX - len(self._ended))]
            self._held_since = time.monotonic()

    def ride(self, pipe: Any, run_id: str) -> SpansRiding | None:
        """Queue the spans ended since the last hand-off on `pipe` (a stage task's first
        read), for run `run_id`'s span list; None when there are none."""
        spans = self.take()
        if not spans:
            return None
        return SpansRiding(self, spans, run_id, queue_spans(pipe, run_id, [self.request(spans)]))

    def push(self, run_id: str) -> None:
        """Push the spans ended since the last hand-off onto run `run_id`'s span list: a ride
        on a pipeline of their own."""
        from tasks.context import redis_client

        pipe = redis_client().pipeline(transaction=False)
        riding = self.ride(pipe, run_id)
        if riding is None:  # nothing recorded (a step not sampled)
            return
        try:
            replies = pipe.execute()
        except Exception:  # a push's error must never reach a task: the spans wait here
            riding.failed()
            return
        riding.landed(replies)

    def delivered(self) -> None:
        self._failing = False

    def undelivered(self, spans: list[bytes]) -> None:
        """Spans that did not reach Redis wait for the next hand-off (said once until one goes)."""
        if not self._failing:
            log.exception("handing %d spans to Redis failed; they wait for the next hand-off", len(spans))
        self._failing = True
        self.give_back(spans)

    def _flush_idle(self) -> None:
        """The flusher: spans no stage task's first read took within `FLUSH_SECONDS` (the
        process idle, or its last tasks prepare tasks) are pushed."""
        while True:
            time.sleep(FLUSH_SECONDS / 2)
            since = self._held_since
            if since is not None and self._run_id and time.monotonic() - since >= FLUSH_SECONDS:
                self.push(self._run_id)

    def process_exit(self) -> None:
        """The process stops: what is still here goes to the last run's list."""
        if self._run_id is not None:
            self.push(self._run_id)


@dataclass
class SpansRiding:
    """Spans queued on a first read's pipeline (`TaskSpans.ride`), told how it went."""

    spans: TaskSpans
    taken: list[bytes]
    run_id: str
    at: int  # the index of the push's reply: the list's length

    def landed(self, replies: list[Any]) -> None:
        from tasks.context import redis_client

        self.spans.delivered()
        with contextlib.suppress(Exception):  # only a statistic
            dropped_spans(redis_client(), self.run_id, int(replies[self.at]))

    def failed(self) -> None:
        self.spans.undelivered(self.taken)
