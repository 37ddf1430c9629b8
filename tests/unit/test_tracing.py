"""Tracing's switch (docs/observability.md, Traces): off and free without an OTLP endpoint;
with one, a problem is one line naming what to install or the variable at fault."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tasks import tracing
from tests.support.processes import REPO


def test_off_without_an_endpoint_sets_nothing_up_and_connects_no_handler():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | {"PYTHONPATH": str(REPO)}
    probe = (
        "import sys, weakref, tasks.ship\n"
        "from celery import signals\n"
        "from tasks import tracing\n"
        "with tracing.span('rlship.zmq_send'): pass\n"
        "refs = [r[1] for r in signals.task_prerun.receivers + signals.before_task_publish.receivers]\n"
        "handlers = [r() if isinstance(r, weakref.ReferenceType) else r for r in refs]\n"
        "assert not any(getattr(h, '__module__', '') == 'tasks.tracing' for h in handlers), handlers\n"
        "assert 'tasks.tracing_sdk' not in sys.modules and not tracing._tracing\n"
        "assert 'tasks.task_spans' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_an_endpoint_turns_it_on(monkeypatch):
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert tracing.enabled() and tracing.problem() is None
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.enabled()


@pytest.mark.parametrize(
    ("protocol", "named"),
    [("grpc", "opentelemetry-exporter-otlp-proto-grpc"), ("http/json", "'http/json'")],
)
def test_a_protocol_that_cannot_run_is_one_line_naming_it(monkeypatch, protocol, named):
    installed = tracing._installed  # the gRPC exporter, as on a host without it
    monkeypatch.setattr(tracing, "_installed", lambda name: name != tracing.GRPC_EXPORTER and installed(name))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    problem = tracing.problem()
    assert problem is not None and named in problem and "\n" not in problem


def test_a_stored_traceparent_gives_its_trace_id():
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    assert tracing.trace_id_of(f"00-{trace_id}-00f067aa0ba902b7-01".encode()) == trace_id
    assert tracing.trace_id_of(None) is None and tracing.trace_id_of(b"garbage") is None


TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.mark.parametrize(
    "value",
    [
        f"00-{TRACE}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}-00",
        f"00-{TRACE}-{SPAN}-09",
        f" 00-{TRACE}-{SPAN}-01 ",
        f"00-{TRACE.upper()}-{SPAN}-01",
        f"01-{TRACE}-{SPAN}-01-later-fields",
        f"00-{TRACE}-{SPAN}-01-more",
        f"ff-{TRACE}-{SPAN}-01",
        f"00-{'0' * 32}-{SPAN}-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE[:-1]}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}",
        f"00-{TRACE}-{SPAN}-0g",
        f"00-{TRACE[:-1]}z-{SPAN}-01",
        f"00_{TRACE}_{SPAN}_01",
        "",
        "-",
        "garbage",
    ],
)
def test_a_tasks_parent_is_read_as_the_w3c_propagator_reads_it(value):
    """`parse_traceparent` reads the header itself (a task's start pays less); the SDK's
    W3C propagator is the oracle: the same ids and flags, or none where it finds none."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    extracted = trace.get_current_span(TraceContextTextMapPropagator().extract({"traceparent": value}))
    context = extracted.get_span_context()
    expected = (context.trace_id, context.span_id, int(context.trace_flags)) if context.is_valid else None
    assert tracing.parse_traceparent(value) == expected, value
