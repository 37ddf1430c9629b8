"""`rlship bench tracing`: what tracing costs a stage task, measured on its own (BENCHMARKS.md,
"Tracing"): CPU seconds of a process that runs `--tasks` tasks, each with its task span and
a send span inside it, the task's spans pushed onto the run's span list in Redis at its end
and relayed by the orchestrator's relay (`orchestrator.span_relay`, in the same process,
counted) to a local OTLP/HTTP receiver that discards (`otlp_sink`, in this process: a
collector's CPU is not the ship path's). Each mode runs in a fresh process, `--rounds` times,
alternating, against a redis-server of the bench's own (its CPU counted too):

- `task-spans`: rlship's, through `tasks.tracing`'s own handlers (`tasks.task_spans`: spans
  made without the SDK's span objects, encoded straight into OTLP);
- `sdk`: the baseline, the same spans made by the OpenTelemetry SDK's tracer and encoded by
  its exporter's public encoder (`encode_spans`), pushed the same way: what rlship did
  before `tasks.task_spans`.

The process's CPU includes its threads (the relay); Redis's is the server's `used_cpu_sys` +
`used_cpu_user` over the round. Per step: the CPU a task times the stage tasks of a step at
`--ranks` (2 + 2 x ranks + 2: finalize, which carries prune and pack, metrics, encode and
send per rank, publish, release).

    rlship bench tracing --tasks 2000 --rounds 3 --ranks 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from orchestrator.commands.bench.otlp_sink import OtlpSink
from orchestrator.commands.sentinel_cluster import start_redis_server
from transport.zmq_sockets import free_port_pair

MODES = ("task-spans", "sdk")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", type=int, default=2000, help="stage tasks a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode, alternating")
    parser.add_argument(
        "--ranks", type=int, default=8, help="for the per-step figure: 2 + 2 x ranks + 2 tasks"
    )


def _sdk_task(tracer: Any, pushed: Any, task: Any, args: list[Any]) -> None:
    """The baseline's task: its spans made by the SDK's tracer, as `tasks.tracing` made them
    before `tasks.task_spans` (consumer kind, the parent from the message's header, the
    task's attributes), encoded by the exporter's public encoder and pushed the same way."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from tasks import tracing
    from tasks.context import redis_client

    trace_id, span_id, flags = tracing.parse_traceparent(task.request.traceparent) or (0, 0, 0)
    remote = trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(flags))
    parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    attributes = tracing._task_attributes(task.name, args, task.request)
    with tracer.start_as_current_span(task.name, context=parent, kind=trace.SpanKind.CONSUMER) as span:
        span.set_attributes(attributes)
        send_attributes = {"rlship.step": args[1], "rlship.rank": 0}
        with tracer.start_as_current_span("rlship.zmq_send", attributes=send_attributes):
            pass
        span.set_attribute("rlship.state", "SUCCESS")
    spans = pushed.get_finished_spans()
    pushed.clear()
    tracing.hold_spans(redis_client(), args[0], [encode_spans(spans).SerializeToString()])


def run_tasks(count: int, mode: str) -> float:
    """In the measured process: `count` send tasks, their spans made as `mode` says, pushed
    to Redis and relayed from there to the receiver; CPU seconds a task."""
    from celery.app.task import Context

    from orchestrator.span_relay import SpanRelay
    from tasks import tracing
    from tasks.app import redis_url
    from tasks.otlp_target import otlp_target
    from tasks.tracing_sdk import Tracing

    class Task:
        name = "rlship.send"

    run_id = f"bench-tracing-{uuid.uuid4().hex[:8]}"

    tracing._worker_tracing = True  # as `connect_celery` sets it in a worker
    found = tracing._tracing[os.getpid()] = Tracing("worker")
    if mode == "sdk":
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        pushed = InMemorySpanExporter()
        found.provider.add_span_processor(SimpleSpanProcessor(pushed))
        tracer = found.provider.get_tracer("rlship")

    def one(task: Task, index: int) -> None:
        task.request = Context(
            id=f"task-{index}",
            retries=0,
            delivery_info={"redelivered": False},
            hostname="bench@host",
            traceparent=tracing.format_traceparent(index + 1, index + 1, 1),
        )
        args = [run_id, index, 0]
        if mode == "sdk":
            _sdk_task(tracer, pushed, task, args)
            return
        tracing._start(task_id=task.request.id, task=task, args=args)
        with tracing.span("rlship.zmq_send", **{"rlship.step": index, "rlship.rank": 0}):
            pass
        tracing._end(task_id=task.request.id, state="SUCCESS")

    relay = SpanRelay(redis_url(), run_id, otlp_target(os.environ))
    task = Task()
    one(task, 0)  # the set-up (SDK, Redis's connection) is not a task's
    relay.relay_once()
    started = time.process_time()
    for index in range(1, count + 1):
        one(task, index)
    while relay.relay_once():  # the orchestrator's share
        pass
    seconds = (time.process_time() - started) / count
    relay.client.delete(relay.keys.spans)
    return seconds


def _redis_cpu(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def main(args: argparse.Namespace) -> int:
    if args.tasks < 1 or args.rounds < 1:
        raise SystemExit("rlship: --tasks and --rounds must be >= 1")
    sink = OtlpSink()
    port = free_port_pair()
    directory = Path(tempfile.mkdtemp(prefix="rlship-bench-tracing-"))
    server = start_redis_server(directory, port)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    per_task: dict[str, list[float]] = {mode: [] for mode in MODES}
    redis_per_task: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for _ in range(args.rounds):
            for mode in MODES:
                child_env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "REDIS_URL": url}
                code = f"from {__name__} import run_tasks; print(run_tasks({args.tasks}, {mode!r}))"
                before = _redis_cpu(client)
                done = subprocess.run(
                    [sys.executable, "-c", code], env=child_env, capture_output=True, text=True, check=True
                )
                redis_per_task[mode].append((_redis_cpu(client) - before) / args.tasks)
                per_task[mode].append(float(done.stdout.strip().splitlines()[-1]))
    finally:
        received = sink.stop()
        client.close()
        server.terminate()
        server.wait(30)
    tasks_a_step = 2 + 2 * args.ranks + 2
    report = {
        "command": f"rlship bench tracing --tasks {args.tasks} --rounds {args.rounds} --ranks {args.ranks}",
        "cpu_ms_per_task": {
            mode: [round(s * 1000, 4) for s in seconds] for mode, seconds in per_task.items()
        },
        "redis_cpu_ms_per_task": {
            mode: [round(s * 1000, 4) for s in seconds] for mode, seconds in redis_per_task.items()
        },
        "tasks_a_step": tasks_a_step,
        "otlp_received": received,
    }
    with_redis = {
        mode: statistics.median(per_task[mode]) + statistics.median(redis_per_task[mode]) for mode in MODES
    }
    report["task_spans_against_sdk"] = round(with_redis["task-spans"] / with_redis["sdk"], 4)
    for mode, seconds in per_task.items():
        median = statistics.median(seconds) * 1000
        redis_median = statistics.median(redis_per_task[mode]) * 1000
        rounds = ", ".join(f"{s * 1000:.3f}" for s in seconds)
        total = median + redis_median
        print(
            f"{mode}: {median:.3f} ms of CPU a task (median of {rounds}) + {redis_median:.3f} ms of Redis's; "
            f"{total * tasks_a_step:.1f} ms a step of {tasks_a_step} stage tasks ({args.ranks} ranks)"
        )
    print(
        f"task-spans against the SDK's spans, Redis's CPU included: {report['task_spans_against_sdk']:.3f}x"
    )
    print(json.dumps(report))
    return 0
