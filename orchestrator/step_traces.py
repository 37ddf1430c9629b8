"""The orchestrator's side of a step's trace (`tasks.tracing` owns the rest): the step's
root span, opened at its cut and ended when its record is published (or with an error
status when the cut is taken back, or the run stops with the step in flight); the
`traceparent` every task it enqueues for the step carries; and the prepare work done
before the cut, each enqueue a span of its own, linked from the root of the step that
shipped its rollouts.

When tracing is off every method returns at once with nothing (no header, no span). The
spans are made as a pool process makes its tasks' (`tasks.task_spans`: the SDK's sampler and
resource, the spans written straight in OTLP's form) and leave with the workers' in the
orchestrator's span relay's next request (`orchestrator.span_relay`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from tasks import tracing
from tasks.manifest import StepManifest
from transport.keys import RunKeys

if TYPE_CHECKING:
    from tasks.task_spans import TaskSpan, TaskSpans

# Rollouts whose prepare span is remembered until their cut (the oldest forgotten first).
PREPARED_REMEMBERED = 1 << 16
# Root spans' trace contexts kept after their publish, for the release enqueued next.
PUBLISHED_REMEMBERED = 64
# A root links at most this many prepare spans (the SDK's default limit, OTEL_SPAN_LINK_COUNT_LIMIT).
LINKS_MAX = 128


class StepTraces:
    def __init__(self, run_id: str) -> None:
        self.enabled = tracing.enabled() and tracing.problem() is None
        self.run_id = run_id
        self.keys = RunKeys(run_id)
        self.roots: dict[int, TaskSpan] = {}  # step -> its open root span
        self.parents: dict[int, str] = {}  # step -> its root's traceparent, for its tasks
        # rollout id -> (trace id, span id) of its prepare span
        self.prepared: OrderedDict[str, tuple[int, int]] = OrderedDict()
        if self.enabled:  # the SDK's imports (a few hundred ms) now, not on the event loop at a cut
            self._spans()

    def _spans(self) -> TaskSpans:
        return tracing.tracing("orchestrator").task_spans

    def prepare_headers(self, rollout_ids: list[str]) -> dict[str, str]:
        """The headers of a prepare task: a span of its own trace (the enqueue; the worker's
        span is its child), remembered for the rollouts, to be linked from their step."""
        if not self.enabled:
            return {}
        from opentelemetry.trace import SpanKind

        spans = self._spans()
        attributes = {"rlship.run_id": self.run_id, "rlship.rollouts": len(rollout_ids)}
        span = spans.open("rlship.prepare", attributes, parent=None, kind=SpanKind.PRODUCER)
        spans.close(span)
        if span.sampled:  # a link only to a span the collector gets
            ids = (span.trace_id, span.span_id)
            for rollout_id in rollout_ids:
                self.prepared[rollout_id] = ids
            while len(self.prepared) > PREPARED_REMEMBERED:
                self.prepared.popitem(last=False)
        return {tracing.TRACEPARENT: span.traceparent}

    def open(self, manifest: StepManifest, policy_version: int) -> str | None:
        """The step's root span, opened at its cut, in a new trace linked to the prepare
        spans of its rollouts; its `traceparent` if sampled (the step's trace key), else None."""
        if not self.enabled:
            return None
        step, cohort = manifest.step, manifest.effective
        found = (self.prepared.pop(rid) for rid in cohort.labels["rollout_id"] if rid in self.prepared)
        linked = tuple(dict.fromkeys(found))  # each prepare span once, in the order first met
        tokens = cohort.numeric["num_input_tokens"].sum() + cohort.numeric["num_output_tokens"].sum()
        self.end(step, "cut again")  # a root left open by a take-back this process did not see
        attributes = {
            "rlship.run_id": self.run_id,
            "rlship.step": step,
            "rlship.policy_version": int(policy_version),
            "rlship.rollouts": len(cohort),
            "rlship.tokens": int(tokens),
            "rlship.prepared_links": len(linked),
        }
        root = self._spans().open("rlship.step", attributes, parent=None, links=linked[:LINKS_MAX])
        self.roots[step] = root
        self.parents[step] = root.traceparent
        return root.traceparent if root.sampled else None

    def headers(self, step: int) -> dict[str, str]:
        """The headers of a task of step `step`: its root span as the parent."""
        parent = self.parents.get(step)
        return {tracing.TRACEPARENT: parent} if parent else {}

    def trace_id(self, step: int) -> str | None:
        """The 32 hex digits of step `step`'s trace, while its context is kept (its stage
        histograms' exemplar: `trace_id`, as Grafana's exemplar link to Jaeger reads it)."""
        return tracing.trace_id_of(self.parents.get(step))

    async def resume(self, client: aioredis.Redis, steps: Sequence[int]) -> None:
        """The trace contexts of steps a previous orchestrator cut (their roots went with it),
        in one read: the tasks enqueued again for them stay in their traces."""
        if not self.enabled or not steps:
            return
        stored = await client.mget([self.keys.trace(step) for step in steps])
        for step, traceparent in zip(steps, stored, strict=True):
            if traceparent is not None:
                self.parents[step] = traceparent.decode()

    def published(self, step: int) -> None:
        """The step's record is published: its root span ends."""
        root = self.roots.pop(step, None)
        if root is not None:
            self._spans().close(root)
        for old in [s for s in self.parents if s <= step - PUBLISHED_REMEMBERED]:
            del self.parents[old]

    def end(self, step: int, why: str) -> None:
        """The step's root span ends with an error status saying `why` (taken back, abandoned)."""
        root = self.roots.pop(step, None)
        if root is not None:
            self._spans().close(root, error=why)

    def close(self) -> None:
        """The run stops: the roots of steps still in flight end, abandoned (the relay, stopped
        after, sends them)."""
        for step in list(self.roots):
            self.end(step, "the run stopped with the step in flight")
