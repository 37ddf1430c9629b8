"""The workers' spans wait in Redis until the orchestrator's relay gets them to the collector
(docs/observability.md, Traces): real Redis, a real process that ends its tasks as a Celery
pool process does (the task signals' handlers, each task's spans riding on the next one's first read, the last
ones leaving at the process's exit), a real
OTLP receiver (HTTP, and gRPC) that is down, then up on the same port. The oracle is what the docs say:
nothing reaches a collector that is down, nothing is lost while it is, every span of every
task arrives once it is up (under its own process's resource), whichever orchestrator is
relaying by then; past the list's cap the oldest entries go, counted."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import Counter

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from orchestrator.span_relay import SpanRelay
from tasks.otlp_target import otlp_target
from tasks.task_spans import FLUSH_SECONDS
from tasks.tracing import SPANS_HELD_MAX, dropped_spans, hold_spans, queue_spans
from tests.support.otlp_receiver import OtlpGrpcReceiver, OtlpReceiver
from tests.support.processes import REPO, free_port, wait_for
from transport.keys import RunKeys

pytestmark = pytest.mark.timeout(120)

TASKS = 12

# A process running `TASKS` send tasks (each with its first read, and its `rlship.zmq_send`
# span inside) through the handlers a pool process's task signals call; prints its pid.
TASK_PROCESS = textwrap.dedent(
    """
    import os, sys, time
    from celery.app.task import Context
    from tasks import tracing
    from tasks.context import StepContext

    run_id, tasks = sys.argv[1], int(sys.argv[2])
    tracing._worker_tracing = True  # as `connect_celery` sets it in a worker

    class Task:
        name = "rlship.send"

    task = Task()
    for index in range(tasks):
        task.request = Context(id=f"task-{index}", retries=0, delivery_info={}, hostname="relay@test")
        tracing._start(task_id=task.request.id, task=task, args=[run_id, index, 0])
        StepContext(run_id, index, task).skip("send")  # its first read: the spans before it ride on it
        with tracing.span("rlship.zmq_send", **{"rlship.step": index, "rlship.rank": 0}):
            pass
        tracing._end(task_id=task.request.id, state="SUCCESS")
    if sys.argv[3] == "exit":
        tracing._flush_at_exit()  # worker_process_shutdown
    else:  # idle this long, then killed: only the flusher hands the last task's spans on
        time.sleep(float(sys.argv[3]))
    print(os.getpid(), flush=True)
    os._exit(0)
    """
)


def run_tasks(redis_url: str, run_id: str, endpoint: str, ending: str = "exit", **otel: str) -> int:
    """Run the tasks in a process of their own (pointed at `endpoint`, with `otel`'s other
    variables), ending as a worker's pool process does (`exit`) or killed after that many
    seconds idle; its pid. A handler that raises fails the process."""
    env = {"PYTHONPATH": str(REPO), "REDIS_URL": redis_url, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **otel}
    done = subprocess.run(
        [sys.executable, "-c", TASK_PROCESS, run_id, str(TASKS), ending],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def spans_of(receiver: OtlpReceiver, run_id: str) -> Counter:
    """(span name, step, the sending process's pid) -> how many arrived, of this run."""
    return Counter(
        (s.name, s.attributes.get("rlship.step"), s.resource.get("process.pid"))
        for s in receiver.received()
        if s.attributes.get("rlship.run_id") == run_id or s.name == "rlship.zmq_send"
    )


def expected(pid: int) -> Counter:
    return Counter(
        {(name, step, pid): 1 for step in range(TASKS) for name in ("rlship.send", "rlship.zmq_send")}
    )


def relay(redis_url: str, run_id: str, endpoint: str, protocol: str = "http/protobuf") -> SpanRelay:
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
    return SpanRelay(redis_url, run_id, otlp_target(environ))


def test_spans_wait_in_redis_while_the_collector_is_down_and_reach_it_once_it_is_up(
    client, redis_url, run_id
):
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    key = RunKeys(run_id).spans
    pid = run_tasks(redis_url, run_id, endpoint)
    # Each task's spans on the next one's first read, the last ones at the process's exit: in
    # Redis, the process gone, no orchestrator relaying yet.
    assert client.llen(key) == TASKS
    assert 0 < client.ttl(key) <= 24 * 3600

    running = relay(redis_url, run_id, endpoint).start()
    receiver = OtlpReceiver(port=port)
    try:
        # The relay takes a batch, the collector does not answer, the batch goes back.
        wait_for("a relay attempt", lambda: running._failing, timeout=30)
        assert client.llen(key) == TASKS and running.relayed == 0
        receiver.start()
        wait_for("every task's spans", lambda: spans_of(receiver, run_id) == expected(pid), timeout=30)
        wait_for("the list emptied", lambda: client.llen(key) == 0, timeout=10)
        # Counted once the collector's answer is in: after the spans arrived, not with them.
        wait_for("the relay's count", lambda: running.relayed >= TASKS, timeout=10)
        assert running.relayed == TASKS
    finally:
        running.stop()
        receiver.stop()
    assert spans_of(receiver, run_id) == expected(pid), "a span arrived twice"
    # In one request: the tasks' requests concatenated are one, each with its resource.
    assert receiver.requests == 1
    assert client.get(RunKeys(run_id).spans_dropped) is None


def test_over_grpc_the_spans_wait_while_the_collector_is_down_and_reach_it_once_it_is_up(
    client, redis_url, run_id
):
    """The relay speaks gRPC to a real gRPC OTLP receiver: the pool processes push as over
    HTTP (`OTEL_EXPORTER_OTLP_PROTOCOL=grpc` in their environment), the batch is sent as it
    is, unparsed, and the receiver decodes one request holding every task's spans."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    pid = run_tasks(redis_url, run_id, endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    assert client.llen(RunKeys(run_id).spans) == TASKS
    running = relay(redis_url, run_id, endpoint, "grpc").start()
    receiver = OtlpGrpcReceiver(port=port)
    try:
        wait_for("a relay attempt", lambda: running._failing, timeout=30)
        assert client.llen(RunKeys(run_id).spans) == TASKS and running.relayed == 0
        receiver.start()
        wait_for("every task's spans", lambda: spans_of(receiver, run_id) == expected(pid), timeout=30)
        wait_for("the relay's count", lambda: running.relayed >= TASKS, timeout=10)
    finally:
        running.stop()
        receiver.stop()
    assert spans_of(receiver, run_id) == expected(pid) and receiver.requests == 1
    assert client.llen(RunKeys(run_id).spans) == 0


def test_what_an_orchestrator_could_not_relay_the_next_one_sends_before_it_exits(client, redis_url, run_id):
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    pid = run_tasks(redis_url, run_id, endpoint)
    first = relay(redis_url, run_id, endpoint).start()
    wait_for("a relay attempt", lambda: first._failing, timeout=30)
    first.stop()  # the run ends with the collector down: the spans stay for the next one
    assert client.llen(RunKeys(run_id).spans) == TASKS and first.relayed == 0

    second = relay(redis_url, run_id, endpoint).start()
    wait_for("a relay attempt", lambda: second._failing, timeout=30)  # now waiting to try again
    receiver = OtlpReceiver(port=port).start()
    try:
        second.stop()  # its run ends: what is left goes before it returns
        assert spans_of(receiver, run_id) == expected(pid)
        assert client.llen(RunKeys(run_id).spans) == 0
    finally:
        receiver.stop()


def test_a_pool_process_idle_after_its_last_task_hands_its_spans_on_before_it_is_killed(
    client, redis_url, run_id
):
    """No next task's first read for them to ride on: the flusher pushes the last task's
    spans within `FLUSH_SECONDS`, so a process killed while idle loses none."""
    run_tasks(redis_url, run_id, f"http://127.0.0.1:{free_port()}", ending=str(4 * FLUSH_SECONDS))
    assert client.llen(RunKeys(run_id).spans) == TASKS


def test_past_the_cap_the_oldest_entries_go_and_are_counted(client, run_id):
    keys = RunKeys(run_id)
    entries = [f"entry-{index}".encode() for index in range(SPANS_HELD_MAX + 4)]
    assert hold_spans(client, run_id, entries[: SPANS_HELD_MAX - 1]) == 0
    assert hold_spans(client, run_id, entries[SPANS_HELD_MAX - 1 :]) == 4
    assert client.llen(keys.spans) == SPANS_HELD_MAX
    assert client.lindex(keys.spans, 0) == b"entry-4" and client.lindex(keys.spans, -1) == entries[-1]
    assert int(client.get(keys.spans_dropped)) == 4
    # A batch given back goes before the rest, and pushes the oldest out too.
    assert hold_spans(client, run_id, [b"given-back-0", b"given-back-1"], oldest=True) == 2
    assert client.lrange(keys.spans, 0, 1) == [b"entry-4", b"entry-5"]
    assert int(client.get(keys.spans_dropped)) == 6
    # Spans riding on a task's first read are trimmed the same way, and counted.
    first_read = client.pipeline(transaction=False)
    first_read.exists(keys.alive)
    at = queue_spans(first_read, run_id, [b"ridden-0", b"ridden-1", b"ridden-2"])
    assert dropped_spans(client, run_id, first_read.execute()[at]) == 3
    assert client.llen(keys.spans) == SPANS_HELD_MAX and client.lindex(keys.spans, -1) == b"ridden-2"
    assert client.lindex(keys.spans, 0) == b"entry-7"
    assert int(client.get(keys.spans_dropped)) == 9
    assert 0 < client.ttl(keys.spans_dropped) <= 24 * 3600


def test_tasks_of_traces_not_sampled_end_quietly_and_push_nothing(client, redis_url, run_id):
    """A sampler that drops the traces (`OTEL_TRACES_SAMPLER`, as the SDK documents it): every
    task still starts and ends through the handlers (no span recorded has no name to read),
    and nothing reaches the run's span list."""
    run_tasks(redis_url, run_id, f"http://127.0.0.1:{free_port()}", OTEL_TRACES_SAMPLER="always_off")
    assert client.llen(RunKeys(run_id).spans) == 0


def test_spans_ride_on_a_first_read_and_wait_for_the_next_when_it_fails(client, run_id):
    """What a pool process ended since its last hand-off goes on the pipeline of a stage
    task's first read, as one entry of the run's list; a first read that fails leaves them
    held, and the next takes them along with what ended since."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from tasks.task_spans import TaskSpans

    spans, keys = TaskSpans(Resource.create({}), TracerProvider().sampler), RunKeys(run_id)

    def task(name: str) -> None:
        span, token = spans.start(name, {"rlship.run_id": run_id}, parent=None)
        spans.end(span, token)

    def first_read(fails: bool = False) -> None:
        pipe = client.pipeline(transaction=False)
        pipe.exists(keys.alive)
        riding = spans.ride(pipe, run_id)
        if fails:
            riding.failed()
        else:
            riding.landed(pipe.execute())

    task("rlship.finalize")
    first_read(fails=True)
    task("rlship.metrics")
    first_read()
    assert spans.ride(client.pipeline(), run_id) is None  # nothing left to hand on
    (entry,) = client.lrange(keys.spans, 0, -1)
    request = ExportTraceServiceRequest.FromString(entry)
    assert [s.name for s in request.resource_spans[0].scope_spans[0].spans] == [
        "rlship.finalize",
        "rlship.metrics",
    ]
