"""Tracing: one OpenTelemetry trace per step, across the orchestrator and the workers (with
a span for each rank's send). This module owns all of it: whether tracing is on, the SDK
set up from the standard `OTEL_*` variables, the trace context a task message carries
(Celery signals: the stage code knows nothing of it), the span of every task, and where a
step's trace id is kept.

Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set:
then rlship imports no OpenTelemetry module and connects no signal handler; what the
stages call (`span`) is a shared no-op. On, each process sets the SDK up on its first span
(after a fork: a Celery pool process sets up its own). OTLP over HTTP
(`http/protobuf`, the default) or gRPC (`OTEL_EXPORTER_OTLP_PROTOCOL=grpc`, its exporter
package installed); `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_TRACES_SAMPLER`, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES` and the rest are read by the SDK as it documents them (and the
exporter's by `tasks.otlp_target` for the orchestrator's relay).

Parents (docs/observability.md, Traces): a task's span is the child of the span that
enqueued it, whose W3C `traceparent` travels in the message's headers. The orchestrator
enqueues a step's first task (and its release) under the step's root span; each stage task
enqueues its successors under its own span, so a fan-in (publish) is the child of the task
that completed it. A message that already carries a `traceparent` keeps it: a Celery retry
and a redelivery after a killed worker are siblings of the first attempt, in the same trace.

Every process makes its spans itself, without the SDK's span objects (`tasks.task_spans`;
the orchestrator's leave with its span relay's requests). A pool process hands its tasks'
spans to the run's span list in Redis on the pipeline of its next stage task's first read
(`ride_spans`), or after `FLUSH_SECONDS` without one (the same commands, `queue_spans`, on a
pipeline of their own), so one killed later loses only the span of the task it was running;
the orchestrator relays the list to the collector, over HTTP or gRPC
(`orchestrator.span_relay`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any

from tasks.graph import STAGE
from transport.keys import RunKeys
from transport.store import DEFAULT_TTL_SECONDS

if TYPE_CHECKING:
    from tasks.task_spans import TaskSpan
    from tasks.tracing_sdk import Tracing

log = logging.getLogger("rlship.tracing")

ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
TRACEPARENT = "traceparent"  # the W3C header, in task messages and in the step's trace key
EXTRA = "pip install 'rlship[tracing]'"
HTTP_EXPORTER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
GRPC_EXPORTER = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
GRPC_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"
# Entries (a task's spans each, about 1 KiB) a run's span list holds while nobody relays them
# (the orchestrator down, the collector not answering); past it the oldest are dropped.
SPANS_HELD_MAX = 20_000


def enabled() -> bool:
    """Whether this process traces: an OTLP endpoint is set and the SDK is not disabled."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(os.environ.get(name, "").strip() for name in ENDPOINT_ENVS)


def protocol() -> str:
    """The OTLP protocol this process's variables ask for."""
    from tasks.otlp_target import protocol_of

    return protocol_of(os.environ)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package missing
        return False


def problem() -> str | None:
    """One line saying why tracing, asked for, cannot run here; None if it can (or is off)."""
    if not enabled():
        return None
    chosen = protocol()
    if chosen not in ("http/protobuf", "grpc"):
        return f"OTEL_EXPORTER_OTLP_PROTOCOL: {chosen!r} is not supported (http/protobuf or grpc)"
    if not _installed("opentelemetry.sdk.trace"):
        return f"OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed: {EXTRA}"
    if not _installed(GRPC_EXPORTER if chosen == "grpc" else HTTP_EXPORTER):
        package = GRPC_PACKAGE if chosen == "grpc" else "opentelemetry-exporter-otlp-proto-http"
        return f"OTEL_EXPORTER_OTLP_PROTOCOL={chosen} needs the package {package} ({EXTRA})"
    from tasks.otlp_target import otlp_target  # the orchestrator relays the workers' spans

    try:
        otlp_target(os.environ)
    except ValueError as bad:
        return str(bad)
    return None


def queue_spans(pipe: Any, run_id: str, entries: list[bytes], *, oldest: bool = False) -> int:
    """Queue on a pipeline the push of encoded spans onto run `run_id`'s span list, at its end
    (or at its start, in their order, with `oldest`: a batch the relay gives back), the trim
    to its newest `SPANS_HELD_MAX` and its expiry's renewal, as plain commands (a script would
    cost redis-py a SCRIPT EXISTS round trip on each execute); returns the index of the
    push's reply, the list's length (`dropped_spans` reads it)."""
    keys = RunKeys(run_id)
    at = len(pipe)
    if oldest:
        pipe.lpush(keys.spans, *reversed(entries))
    else:
        pipe.rpush(keys.spans, *entries)
    pipe.ltrim(keys.spans, -SPANS_HELD_MAX, -1)
    pipe.expire(keys.spans, DEFAULT_TTL_SECONDS)
    return at


def dropped_spans(client: Any, run_id: str, length: int) -> int:
    """The entries a `queue_spans` push of a list now `length` long trimmed off its head,
    counted in `RunKeys.spans_dropped` (a round trip only then)."""
    dropped = max(0, length - SPANS_HELD_MAX)
    if dropped:
        count_dropped_spans(client, run_id, dropped)
        log.warning("rlship: %d entries of run %s's span list dropped (past its cap)", dropped, run_id)
    return dropped


def hold_spans(client: Any, run_id: str, entries: list[bytes], *, oldest: bool = False) -> int:
    """Put encoded spans (OTLP `ExportTraceServiceRequest`s) on run `run_id`'s span list now,
    on a pipeline of their own (`queue_spans`), the entries dropped counted in
    `RunKeys.spans_dropped`. Returns how many. A sync redis-py client."""
    pipe = client.pipeline(transaction=False)
    at = queue_spans(pipe, run_id, entries, oldest=oldest)
    return dropped_spans(client, run_id, int(pipe.execute()[at]))


def count_dropped_spans(client: Any, run_id: str, dropped: int) -> None:
    """Count `dropped` entries of the run's span list as dropped (refused by the collector,
    or trimmed past its cap)."""
    keys = RunKeys(run_id)
    pipe = client.pipeline(transaction=True)
    pipe.incrby(keys.spans_dropped, dropped)
    pipe.expire(keys.spans_dropped, DEFAULT_TTL_SECONDS)
    pipe.execute()


# -- the SDK, once per process (`tasks.tracing_sdk`, imported only when tracing is on) ------

_tracing: dict[int, Tracing] = {}


def tracing(role: str) -> Tracing:
    """This process's `Tracing`, set up on first use (a forked child sets up its own)."""
    found = _tracing.get(os.getpid())
    if found is None:
        from tasks.tracing_sdk import Tracing

        found = _tracing[os.getpid()] = Tracing(role)
    return found


# -- context ---------------------------------------------------------------------------------


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The W3C `traceparent` of a span's ids and trace flags (`parse_traceparent`'s inverse)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


_LOWER_HEX = frozenset("0123456789abcdef")


def parse_traceparent(value: str | bytes | None) -> tuple[int, int, int] | None:
    """(trace id, span id, trace flags) of a W3C `traceparent` (None: none, or malformed).
    Read here rather than by the W3C propagator: every task starts with it, and the
    propagator's regular expressions and carrier cost a task more than its parent is worth."""
    if not value:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    parts = text.strip().split("-")
    fields = parts[:4]
    if [len(part) for part in fields] != [2, 32, 16, 2] or not _LOWER_HEX.issuperset("".join(fields)):
        return None
    if fields[0] == "ff" or (fields[0] == "00" and len(parts) != 4):
        return None
    trace_id, span_id, flags = (int(part, 16) for part in fields[1:])
    return (trace_id, span_id, flags) if trace_id and span_id else None


def trace_id_of(value: str | bytes | None) -> str | None:
    """The 32 hex digits of the trace a `traceparent` (as stored) belongs to."""
    if not value:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    parts = text.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def step_trace_id(client: Any, run_id: str, step: int) -> str | None:
    """Step `step`'s trace id (32 hex), in one Redis read: None when the step was not traced
    (tracing off, or not sampled) or its key has expired. A sync redis-py client."""
    return trace_id_of(client.get(RunKeys(run_id).trace(step)))


def _current_traceparent() -> str | None:
    """The `traceparent` of the task span this thread is in (`tasks.task_spans`; no rlship
    process makes the SDK's spans); None when off or outside any."""
    found = _tracing.get(os.getpid())
    current = found.task_spans.current() if found is not None else None
    return current.traceparent if current is not None else None


def current_trace_id() -> str | None:
    """The trace id of the span this thread is in (for log lines); None when off or outside."""
    return trace_id_of(_current_traceparent())


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[None]:
    """A span inside the current task's (the ZMQ or file send of a rank); free when off."""
    if not _worker_tracing:
        return contextlib.nullcontext()
    return tracing("worker").task_spans.child(name, attributes)


def ended_span(name: str, seconds: float, error: str | None = None, **attributes: Any) -> None:
    """A span inside the current task's that took `seconds` and ends now, with an error
    status if `error` (one rank's send among several leaving side by side); free when off."""
    if _worker_tracing:
        tracing("worker").task_spans.ended_child(name, attributes, seconds, error)


# -- Celery: the context in task headers, a span per task --------------------------------------


def _task_attributes(task_name: str, args: Any, request: Any) -> dict[str, Any]:
    stage = STAGE.get(task_name.removeprefix("rlship."))
    args = list(args or ())
    attributes: dict[str, Any] = {
        "messaging.system": "celery",
        "messaging.message.id": request.id or "",
        "rlship.worker": request.hostname or "",
    }
    # Set only when they say something: each attribute is a task's cost twice (made, encoded).
    if request.retries:
        attributes["rlship.retries"] = int(request.retries)
    if (request.delivery_info or {}).get("redelivered"):
        attributes["rlship.redelivered"] = True
    if args:
        attributes["rlship.run_id"] = str(args[0])
    if stage is not None and len(args) > 1:
        attributes["rlship.stage"] = stage.name
        attributes["rlship.step"] = int(args[1])
        if stage.per_rank and len(args) > 2:
            attributes["rlship.rank"] = int(args[2])
    elif len(args) > 1 and isinstance(args[1], list):
        attributes["rlship.rollouts"] = len(args[1])
    return attributes


# task id -> (span, the token that made it current)
_open_spans: dict[str, tuple[TaskSpan, Any]] = {}


def _inject(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """before_task_publish: a message without a trace context gets the current span's (the
    enqueueing task's); one with it keeps it (a retry, or the orchestrator's explicit one)."""
    if headers is None or headers.get(TRACEPARENT):
        return
    current = _current_traceparent()
    if current is not None:
        headers[TRACEPARENT] = current


def _start(task_id: str | None = None, task: Any = None, args: Any = None, **_: Any) -> None:
    """task_prerun: the task's span, current while it runs, child of the enqueuer's."""
    from opentelemetry.trace import SpanKind

    request = task.request
    attributes = _task_attributes(task.name, args, request)
    parent = parse_traceparent(getattr(request, TRACEPARENT, None))
    spans = tracing("worker").task_spans
    spans.serving(attributes.get("rlship.run_id"))
    span_, token = spans.start(task.name, attributes, parent=parent, kind=SpanKind.CONSUMER)
    _open_spans[task_id or ""] = (span_, token)


def _end(task_id: str | None = None, state: str | None = None, retval: Any = None, **_: Any) -> None:
    """task_postrun: the task's span ends (an error status if it failed); it leaves with the
    process's next stage task's first read (`ride_spans`)."""
    opened = _open_spans.pop(task_id or "", None)
    if opened is None:
        return
    span_, token = opened
    span_.attributes["rlship.state"] = state or ""
    tracing("worker").task_spans.end(span_, token, error=repr(retval)[:200] if state == "FAILURE" else None)


class _NothingRiding:
    def landed(self, replies: list[Any]) -> None:
        return None

    def failed(self) -> None:
        return None


NOTHING_RIDING = _NothingRiding()


def ride_spans(pipe: Any, run_id: str) -> Any:
    """Queue this pool process's spans ended since they last left on `pipe`, the pipeline of
    a stage task's first read (`StepContext.first_read`): they cost no round trip of their
    own. What it returns is told how the pipeline went (`landed` with its replies, or
    `failed`: the spans wait for the next ride). Nothing when tracing is off."""
    if not _worker_tracing:
        return NOTHING_RIDING
    return tracing("worker").task_spans.ride(pipe, run_id) or NOTHING_RIDING


def _set_up(**_: Any) -> None:
    """worker_process_init: the SDK set up as the pool process starts, not in its first task."""
    tracing("worker")


def _flush_at_exit(**_: Any) -> None:
    """worker_process_shutdown: what is still held leaves with the process."""
    found = _tracing.get(os.getpid())
    if found is not None:
        found.task_spans.process_exit()


_worker_tracing = False


def connect_celery(signals: Any) -> None:
    """Connect the handlers (called once by `tasks.app`, when tracing is on)."""
    global _worker_tracing
    _worker_tracing = True
    signals.before_task_publish.connect(_inject, weak=False)
    signals.task_prerun.connect(_start, weak=False)
    signals.task_postrun.connect(_end, weak=False)
    signals.worker_process_init.connect(_set_up, weak=False)
    signals.worker_process_shutdown.connect(_flush_at_exit, weak=False)
