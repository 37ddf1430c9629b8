"""One trace per step, across processes (docs/observability.md, Traces): a real run (real
Redis, a cpu worker of two pool processes, the ship worker, two trainer ranks) with
OTEL_EXPORTER_OTLP_ENDPOINT pointing at a real OTLP receiver in this process, over HTTP and
over gRPC, one worker killed in the middle of a task. The oracle is the documented span tree, written out
here: the stage graph as docs/observability.md draws it, not `tasks.graph`."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator

import pytest

from orchestrator.span_relay import SpanRelay
from orchestrator.step_traces import StepTraces
from tasks import tracing
from tasks.cohort import Cohort
from tasks.faults import arm
from tasks.manifest import ShipConfig, StepManifest
from tests.support.otlp_receiver import OtlpGrpcReceiver, OtlpReceiver, ReceivedSpan
from tests.support.processes import Workers, refused, rlship, running_workers, wait_for
from tests.support.shiprun import deterministic_run, ship
from transport.connection import connect_redis_async
from transport.keys import RunKeys

pytestmark = pytest.mark.timeout(180)

STEPS = 3
RANKS = 2
KILLED_STEP, KILLED_RANK = 1, 1  # its encode's pool process is killed after computing
# Each task span's parent, by the documented tree: the root ("step"), or the task spans that
# may have enqueued it ("same rank": the predecessor's span of the task's own rank).
PARENTS = {
    "rlship.finalize": {"step"},
    "rlship.prune": {"rlship.finalize"},
    "rlship.metrics": {"rlship.prune"},
    "rlship.pack": {"rlship.prune"},
    "rlship.encode": {"rlship.pack"},
    "rlship.send": {"same rank rlship.encode"},
    "rlship.zmq_send": {"rlship.send"},  # a send task sends every rank whose payload is ready
    "rlship.publish": {"rlship.metrics", "rlship.send"},
    "rlship.release": {"step"},
}
PER_RANK = {"rlship.encode", "rlship.send", "rlship.zmq_send"}
ERROR = 2  # OTLP Status.code


@pytest.fixture(scope="module", params=["http/protobuf", "grpc"])
def receiver(request) -> Iterator[OtlpReceiver]:
    running = (OtlpGrpcReceiver() if request.param == "grpc" else OtlpReceiver()).start()
    yield running
    running.stop()
    # This process traced as the orchestrator with this receiver's protocol: the next starts anew.
    found = tracing._tracing.pop(os.getpid(), None)
    if found is not None:
        found.provider.shutdown()


def otel_env(receiver: OtlpReceiver) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": receiver.protocol,
    }


@pytest.fixture(scope="module")
def traced_workers(redis_url, receiver, tmp_path_factory) -> Iterator[Workers]:
    env = {**otel_env(receiver), "RLSHIP_FAULTS": "1"}
    with running_workers(redis_url, tmp_path_factory.mktemp("traced-worker-logs"), env=env) as pool:
        yield pool


def rank_of(span: ReceivedSpan) -> int | None:
    return span.attributes.get("rlship.rank")


def step_traces(spans: list[ReceivedSpan], run_id: str) -> dict[int, list[str]]:
    """Step number -> the ids of the traces whose root is that step of the run."""
    found: dict[int, list[str]] = defaultdict(list)
    for span in spans:
        if span.name == "rlship.step" and span.attributes.get("rlship.run_id") == run_id:
            found[span.attributes["rlship.step"]].append(span.trace_id)
    return found


def complete(spans: list[ReceivedSpan], run_id: str) -> bool:
    """Every step's root and every step's release have arrived (release is the last task)."""
    roots = step_traces(spans, run_id)
    released = {s.attributes.get("rlship.step") for s in spans if s.name == "rlship.release"}
    return set(roots) == set(range(STEPS)) and set(range(STEPS)) <= released


def test_every_step_has_one_trace_with_every_stage_span_of_every_rank(
    client, redis_url, run_id, traced_workers, receiver, tmp_path, monkeypatch
):
    for name, value in otel_env(receiver).items():
        monkeypatch.setenv(name, value)  # the orchestrator, here
    settings = deterministic_run(client, run_id, redis_url, traced_workers, tmp_path, STEPS)
    arm(client, run_id, "encode", step=KILLED_STEP, rank=KILLED_RANK)
    result = ship(settings, produce=False)
    assert [int(r["step"]) for r in result.records] == list(range(STEPS))
    assert client.hlen(RunKeys(run_id).faults) == 0, "the armed fault fired: a pool process was killed"

    wait_for("every step's spans", lambda: complete(receiver.received(), run_id), timeout=30)
    spans = receiver.received()
    by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span)
    traces = step_traces(spans, run_id)
    assert {step: len(ids) for step, ids in traces.items()} == dict.fromkeys(range(STEPS), 1), traces

    task_pids: set[tuple[str, int]] = set()
    for step in range(STEPS):
        trace_id = traces[step][0]
        members = by_trace[trace_id]
        # No span of this step in another trace, and every span here is of this step.
        elsewhere = [
            s for s in spans
            if s.trace_id != trace_id and s.attributes.get("rlship.run_id") == run_id
            and s.attributes.get("rlship.step") == step
        ]  # fmt: skip
        assert elsewhere == [], f"step {step}: spans outside its trace: {elsewhere}"
        assert {s.attributes.get("rlship.step") for s in members} == {step}
        (root,) = [s for s in members if s.name == "rlship.step"]
        assert root.parent_id == "" and root.status_code != ERROR
        assert root.attributes["rlship.rollouts"] == settings.batch_size
        assert root.attributes["rlship.tokens"] > 0
        assert "rlship.policy_version" in root.attributes
        ids = {s.span_id: s for s in members}
        tasks = [s for s in members if s is not root]
        names = {(s.name, rank_of(s)) for s in tasks}
        expected = {
            (name, rank) for name in PARENTS for rank in (range(RANKS) if name in PER_RANK else [None])
        }
        assert expected <= names, f"step {step}: missing {expected - names}"
        for span in tasks:
            allowed = PARENTS[span.name]
            parent = ids.get(span.parent_id)
            assert parent is not None or span.parent_id == root.span_id, f"{span.name}: parent not here"
            if span.parent_id == root.span_id:
                assert "step" in allowed, f"step {step}: {span.name} {rank_of(span)} is a child of the root"
                continue
            same_rank = f"same rank {parent.name}" in allowed and rank_of(parent) == rank_of(span)
            assert parent.name in allowed or same_rank, (
                f"step {step}: {span.name} rank {rank_of(span)} under {parent.name} rank {rank_of(parent)}"
            )
            if span.name != "rlship.zmq_send":
                task_pids.add((span.resource["host.name"], span.resource["process.pid"]))
        # The trace id a reader with the step number gets in one Redis read is this trace's.
        assert client.get(RunKeys(run_id).trace(step)).decode().split("-")[1] == trace_id

    assert len(task_pids) >= 2, f"task spans came from {task_pids}"
    services = {s.resource.get("service.name") for s in spans if s.attributes.get("rlship.run_id") == run_id}
    assert {"rlship-orchestrator", "rlship-worker"} <= services

    # The killed encode: its redelivery is a span of the step's trace, beside the first try
    # (lost with its process), under the same parent.
    killed = [
        s for s in by_trace[traces[KILLED_STEP][0]]
        if s.name == "rlship.encode" and rank_of(s) == KILLED_RANK
    ]  # fmt: skip
    assert [s.attributes["rlship.redelivered"] for s in killed] == [True], killed

    # The prepare work before the cuts: the roots link to the prepare spans of their rollouts.
    prepares = {(s.trace_id, s.span_id): s for s in spans if s.name == "rlship.prepare"}
    roots = [s for trace in traces.values() for s in by_trace[trace[0]] if s.name == "rlship.step"]
    linked = [link for root in roots for link in root.links]
    assert linked, "no root links to a prepare span"
    assert all(link in prepares for link in linked), "a root links to something else than a prepare"
    # The orchestrator's enqueue span is the parent of the worker's (whose span leaves with
    # that process's next stage task: the last prepare of a process may not have yet).
    workers_prepares = [s for link in linked for s in by_trace[link[0]] if s.parent_id == link[1]]
    assert workers_prepares and {s.name for s in workers_prepares} == {"rlship.prepare"}
    assert {s.resource["rlship.role"] for s in workers_prepares} == {"worker"}


@pytest.mark.timeout(60)
def test_rlship_run_refuses_in_one_line_when_its_processes_could_not_trace(tmp_path):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    done = rlship("run", "--steps", "1", "--output-dir", str(tmp_path), env=env)
    refused(done, "OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json'")


def test_a_root_taken_back_or_abandoned_ends_with_an_error(receiver, monkeypatch, redis_url):
    """A cut taken back (every rollout dropped) ends its root with an error status, and so
    does a run that stops with steps in flight; the status says which. The orchestrator's
    spans leave with its span relay, stopped after the roots end, as `Orchestrator.run` does."""
    for name, value in otel_env(receiver).items():
        monkeypatch.setenv(name, value)
    run_id = f"roots-{uuid.uuid4().hex[:8]}"
    traces = StepTraces(run_id)
    relay = SpanRelay.for_run(redis_url, run_id).start()
    for step in (5, 6):
        config = ShipConfig(ranks=2, seq_len=512)
        manifest = StepManifest(run_id, step, step - 1, time.time(), config, Cohort(), Cohort())
        assert traces.open(manifest, policy_version=3) is not None
    traces.end(5, "every rollout dropped: the cut is taken back")
    traces.close()
    relay.stop()

    def roots() -> dict[int, ReceivedSpan]:
        found = receiver.received()
        return {s.attributes["rlship.step"]: s for s in found if s.attributes.get("rlship.run_id") == run_id}

    ended = wait_for("both roots", lambda: len(roots()) == 2 and roots())
    assert ended[5].status_code == ended[6].status_code == ERROR
    assert ended[5].trace_id != ended[6].trace_id


def test_a_resuming_orchestrator_enqueues_a_steps_tasks_in_the_trace_its_predecessor_opened(
    client, redis_url, run_id, receiver, monkeypatch
):
    """The root of a step in flight goes with a killed orchestrator; the next one reads the
    step's `traceparent` from Redis, and the tasks it enqueues again carry it."""
    for name, value in otel_env(receiver).items():
        monkeypatch.setenv(name, value)
    stored = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    client.set(RunKeys(run_id).trace(7), stored, ex=60)
    traces = StepTraces(run_id)

    async def resume() -> None:
        redis_async = connect_redis_async(redis_url)
        try:
            await traces.resume(redis_async, [7, 8])
        finally:
            await redis_async.aclose()

    asyncio.run(resume())
    assert traces.headers(7) == {"traceparent": stored}
    assert traces.headers(8) == {}, "a step without a stored trace carries none"
