"""A pool process's task spans (`tasks.task_spans`), made without the SDK's span objects:
the OpenTelemetry SDK is the oracle. The same spans made by the SDK's tracer (same parent,
names, kinds, attributes, status) and encoded by its exporter's public `encode_spans` must
decode to the same OTLP request, ids and times aside (random and clock-made on both sides,
so compared by shape: which span is whose parent, and start <= end within the test's
window); the SDK's samplers, as `OTEL_TRACES_SAMPLER` names them, decide which spans are
kept, the ratio sampler by its documented rule on the trace id's low 64 bits."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode

from tasks.task_spans import TaskSpans

RESOURCE = {
    "service.name": "rlship-worker",
    "process.pid": 4242,
    "rlship.role": "worker",
    "x.list": ["a", "b"],
}
PARENT = (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)  # a message's traceparent
TASK_ATTRIBUTES = {
    "messaging.system": "celery",
    "messaging.message.id": "c0ffee",
    "rlship.run_id": "run-1",
    "rlship.step": 3,
    "rlship.redelivered": True,
    "rlship.ratio": 0.25,
    # every kind of value the wire encoder writes: negative and many-byte ints, a list, bytes
    "x.offset": -5,
    "x.bytes_held": 2**40 + 7,
    "x.ranks": (0, 1, 300),
    "x.tags": ("a", "b"),
    "x.raw": b"\x00\x01",
    "x.text": "é" * 100,  # a length of two bytes' varint
}
SEND_ATTRIBUTES = {"rlship.step": 3, "rlship.rank": 1}
ERROR = "ValueError('" + "bad " * 48 + "')"  # as long as a failed task's (200 characters)


def normalized(body: bytes, window: tuple[int, int]) -> ExportTraceServiceRequest:
    """The request with ids (links' too) replaced by their order of first appearance and times zeroed,
    after checking they are well-formed and inside `window` (ns)."""
    request = ExportTraceServiceRequest.FromString(body)
    names: dict[bytes, bytes] = {}

    def renamed(value: bytes) -> bytes:
        return names.setdefault(value, len(names).to_bytes(1, "big")) if value else b""

    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                assert len(span.trace_id) == 16 and len(span.span_id) == 8
                assert window[0] <= span.start_time_unix_nano <= span.end_time_unix_nano <= window[1]
                span.trace_id = renamed(span.trace_id)
                span.span_id, span.parent_span_id = renamed(span.span_id), renamed(span.parent_span_id)
                for link in span.links:
                    link.trace_id, link.span_id = renamed(link.trace_id), renamed(link.span_id)
                span.start_time_unix_nano = span.end_time_unix_nano = 0
    return request


def parent_context(parent: tuple[int, int, int]):
    trace_id, span_id, flags = parent
    context = trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(flags))
    return trace.set_span_in_context(trace.NonRecordingSpan(context))


def the_sdks_tracer() -> tuple[Resource, TracerProvider, InMemorySpanExporter, trace.Tracer]:
    """The oracle's side: the SDK's tracer with the test's resource, its ended spans kept."""
    resource = Resource.create(RESOURCE)
    provider = TracerProvider(resource=resource)
    ended = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(ended))
    return resource, provider, ended, provider.get_tracer("rlship")


def test_a_tasks_spans_encode_as_the_sdks_spans_encoded_by_its_exporter():
    resource, provider, ended, tracer = the_sdks_tracer()
    started = time.time_ns()

    # The oracle: a task (consumer, remote parent) with a send inside it, a failed task, a root.
    task = tracer.start_span(
        "rlship.send", context=parent_context(PARENT), kind=SpanKind.CONSUMER, attributes=TASK_ATTRIBUTES
    )
    with trace.use_span(task, end_on_exit=False):
        tracer.start_span("rlship.zmq_send", attributes=SEND_ATTRIBUTES).end()
    task.set_attribute("rlship.state", "SUCCESS")
    task.end()
    failed = tracer.start_span("rlship.encode", context=parent_context(PARENT), kind=SpanKind.CONSUMER)
    failed.set_attribute("rlship.state", "FAILURE")
    failed.set_status(Status(StatusCode.ERROR, ERROR))
    failed.end()
    tracer.start_span("rlship.prepare", kind=SpanKind.CONSUMER, attributes={"rlship.rollouts": 4}).end()
    expected = encode_spans(ended.get_finished_spans()).SerializeToString()

    spans = TaskSpans(resource, provider.sampler)
    span, token = spans.start("rlship.send", dict(TASK_ATTRIBUTES), parent=PARENT, kind=SpanKind.CONSUMER)
    assert spans.current() is span
    with spans.child("rlship.zmq_send", dict(SEND_ATTRIBUTES)):
        assert spans.current() is not span and spans.current().parent_id == span.span_id
    assert spans.current() is span
    span.attributes["rlship.state"] = "SUCCESS"
    spans.end(span, token)
    assert spans.current() is None
    span, token = spans.start("rlship.encode", {}, parent=PARENT, kind=SpanKind.CONSUMER)
    span.attributes["rlship.state"] = "FAILURE"
    spans.end(span, token, error=ERROR)
    span, token = spans.start("rlship.prepare", {"rlship.rollouts": 4}, parent=None, kind=SpanKind.CONSUMER)
    spans.end(span, token)
    got = spans.request(spans.take())
    window = (started, time.time_ns())

    assert normalized(got, window) == normalized(expected, window)
    assert spans.take() == []  # taken once


def test_a_span_carries_its_trace_on_and_a_child_inherits_it():
    spans = TaskSpans(Resource.create({}), TracerProvider().sampler)
    span, token = spans.start("rlship.finalize", {}, parent=PARENT, kind=SpanKind.CONSUMER)
    trace_id, parent_id, _ = PARENT
    assert (span.trace_id, span.parent_id, span.sampled) == (trace_id, parent_id, True)
    assert span.traceparent == f"00-{trace_id:032x}-{span.span_id:016x}-01"
    with spans.child("rlship.prune", {}):
        child = spans.current()
        assert (child.trace_id, child.parent_id) == (trace_id, span.span_id)
    spans.end(span, token)


@pytest.mark.parametrize("sampler", ["always_off", "parentbased_always_off"])
def test_a_sampler_that_drops_records_nothing_and_says_so_downstream(monkeypatch, sampler):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    provider = TracerProvider()
    spans = TaskSpans(provider.resource, provider.sampler)
    span, token = spans.start("rlship.send", dict(TASK_ATTRIBUTES), parent=None, kind=SpanKind.CONSUMER)
    with spans.child("rlship.zmq_send", {}):
        assert not spans.current().sampled
    spans.end(span, token)
    assert spans.take() == [] and span.traceparent.endswith("-00")


def test_a_parent_not_sampled_is_followed_by_the_default_sampler():
    provider = TracerProvider()  # parentbased_always_on, the SDK's default
    spans = TaskSpans(provider.resource, provider.sampler)
    trace_id, span_id, _ = PARENT
    span, token = spans.start("rlship.send", {}, parent=(trace_id, span_id, 0), kind=SpanKind.CONSUMER)
    spans.end(span, token)
    assert not span.sampled and spans.take() == []


def test_the_ratio_sampler_keeps_the_roots_its_rule_keeps():
    """`traceidratio` 0.5: a root is kept when its trace id's low 64 bits are below half
    their range (the SDK's documented rule); its children follow it."""
    spans = TaskSpans(Resource.create({}), ParentBased(TraceIdRatioBased(0.5)))
    kept = 0
    for _ in range(64):
        span, token = spans.start("rlship.prepare", {}, parent=None, kind=SpanKind.CONSUMER)
        with spans.child("rlship.zmq_send", {}):
            assert spans.current().sampled == span.sampled
        spans.end(span, token)
        assert span.sampled == ((span.trace_id & (2**64 - 1)) < 2**63)
        kept += span.sampled
    assert len(spans.take()) == 2 * kept and 0 < kept < 64


def test_attributes_that_never_repeat_keep_the_kept_bytes_bounded_and_every_span_right():
    """A task's message id is new with every task: the writer's store of attribute bytes
    stays within its cap, and each span still decodes (by the generated `Span` class) to
    its own attributes, before and after the store is emptied."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    from tasks import otlp_wire

    for index in range(3 * otlp_wire._ATTRIBUTES_CACHED):
        message_id = f"task-{index}"
        encoded = otlp_wire.span(
            trace_id=index + 1,
            span_id=index + 1,
            parent_id=0,
            name="rlship.encode",
            kind=Span.SPAN_KIND_CONSUMER,
            start_ns=1,
            end_ns=2,
            attributes={"messaging.message.id": message_id, "rlship.run_id": "run-1", "rlship.step": index},
            error=None,
            flags=256,
        )
        assert len(otlp_wire._attribute_bytes) <= otlp_wire._ATTRIBUTES_CACHED
        if index % 1000 == 0 or index == 3 * otlp_wire._ATTRIBUTES_CACHED - 1:
            decoded = Span.FromString(encoded)
            got = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in decoded.attributes}
            assert got == {"messaging.message.id": message_id, "rlship.run_id": "run-1", "rlship.step": index}


def test_the_orchestrators_spans_encode_as_the_sdks_spans_encoded_by_its_exporter():
    """The orchestrator's spans (`orchestrator.step_traces`): prepare enqueues (producer
    roots of their own traces) and a step's root linked to them, one ended with an error
    (a cut taken back), made by `open` and `close` and never current."""
    resource, provider, ended, tracer = the_sdks_tracer()
    started = time.time_ns()
    prepare_attributes = {"rlship.run_id": "run-1", "rlship.rollouts": 128}
    root_attributes = {"rlship.run_id": "run-1", "rlship.step": 4, "rlship.prepared_links": 2}

    prepares = []
    for _ in range(2):
        span = tracer.start_span("rlship.prepare", kind=SpanKind.PRODUCER, attributes=prepare_attributes)
        span.end()
        prepares.append(span.get_span_context())
    root = tracer.start_span(
        "rlship.step", links=[trace.Link(c) for c in prepares], attributes=root_attributes
    )
    root.end()
    taken_back = tracer.start_span("rlship.step", attributes=root_attributes)
    taken_back.set_status(Status(StatusCode.ERROR, "cut again"))
    taken_back.end()
    expected = encode_spans(ended.get_finished_spans()).SerializeToString()

    spans = TaskSpans(resource, provider.sampler, hand_off_idle=False)
    linked = []
    for _ in range(2):
        span = spans.open("rlship.prepare", dict(prepare_attributes), parent=None, kind=SpanKind.PRODUCER)
        spans.close(span)
        linked.append((span.trace_id, span.span_id))
    root = spans.open("rlship.step", dict(root_attributes), parent=None, links=tuple(linked))
    assert spans.current() is None, "an orchestrator's span is never current"
    spans.close(root)
    taken_back = spans.open("rlship.step", dict(root_attributes), parent=None)
    spans.close(taken_back, error="cut again")
    got = spans.request(spans.take())
    window = (started, time.time_ns())

    assert normalized(got, window) == normalized(expected, window)
