"""What the workers and trainer ranks count for the orchestrator's Prometheus endpoint, in
the run's Redis (they are other processes): each task's wait in its queue, the deliveries
that failed, the trainer ranks' idle seconds. Each write goes on a pipeline the caller
runs anyway where it can, so counting costs no round trip of its own.

The queue wait is a histogram kept as Redis hash fields (`RunKeys.queue_wait`): per queue
kind (`cpu`, `ship`), `{kind}:le:{bound}` counts the waits whose smallest bucket bound is
`bound` (not cumulative: one field written per task), `{kind}:sum` and `{kind}:count`.
`queue_wait_histograms` turns them into Prometheus' cumulative buckets.

The enqueue time travels with the task as a message header (`ENQUEUED_AT_HEADER`), set in
the one place every task message of every process is published: Celery's
`before_task_publish` signal (`stamp_enqueue_time`, connected by `tasks.app`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from transport.keys import RunKeys

ENQUEUED_AT_HEADER = "rlship_enqueued_at"

# Seconds: a task waits milliseconds on an idle worker, minutes behind a backlog.
QUEUE_WAIT_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
INF = float("inf")


def stamp_enqueue_time(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """`before_task_publish`: the message's enqueue time (unix seconds), in its headers. A
    retry is published again, so it is stamped again."""
    if headers is not None:
        headers[ENQUEUED_AT_HEADER] = time.time()


def queue_wait_seconds(request: Any, now: float) -> float | None:
    """How long the delivery `request` (a Celery task's `request`) waited in its queue: from
    its enqueue, or from its due time if it had one (a retry's countdown is no wait), to
    `now`. None for a message without the header (published by a process without it)."""
    enqueued = getattr(request, ENQUEUED_AT_HEADER, None)
    if enqueued is None:
        return None
    ready = float(enqueued)
    eta = getattr(request, "eta", None)
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if eta is not None:
        ready = max(ready, eta.timestamp())
    return max(0.0, now - ready)


def bucket_field(kind: str, bound: float) -> str:
    return f"{kind}:le:{'+Inf' if bound == INF else repr(bound)}"


def note_queue_wait(pipe: Any, keys: RunKeys, kind: str, seconds: float, ttl: int) -> None:
    """Queue on `pipe` one wait of `seconds` in a queue of `kind` (`cpu`, `ship`)."""
    bound = next((b for b in QUEUE_WAIT_BUCKETS if seconds <= b), INF)
    pipe.hincrby(keys.queue_wait, bucket_field(kind, bound), 1)
    pipe.hincrbyfloat(keys.queue_wait, f"{kind}:sum", seconds)
    pipe.hincrby(keys.queue_wait, f"{kind}:count", 1)
    pipe.expire(keys.queue_wait, ttl)


def note_failure(pipe: Any, keys: RunKeys, stage: str, ttl: int) -> None:
    """Queue on `pipe` one failed delivery of `stage`."""
    pipe.hincrby(keys.task_failures, stage, 1)
    pipe.expire(keys.task_failures, ttl)


def note_idle(pipe: Any, keys: RunKeys, rank: int, seconds: float, ttl: int) -> None:
    """Queue on `pipe` `seconds` more that trainer `rank` waited with no step to take."""
    pipe.hincrbyfloat(keys.trainer_idle, str(rank), seconds)
    pipe.expire(keys.trainer_idle, ttl)


@dataclass(frozen=True)
class CumulativeHistogram:
    """One histogram as Prometheus exposes it: (upper bound, observations at most it), the
    last bound +Inf holding the count; and the sum of the observations."""

    buckets: list[tuple[float, int]]
    total: float


def queue_wait_histograms(raw: Mapping[bytes, bytes]) -> dict[str, CumulativeHistogram]:
    """Per queue kind with any wait, its histogram, from the hash's raw fields (HGETALL)."""
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    kinds = sorted({name.split(":", 1)[0] for name in fields})
    histograms = {}
    for kind in kinds:
        running, buckets = 0, []
        for bound in (*QUEUE_WAIT_BUCKETS, INF):
            running += int(fields.get(bucket_field(kind, bound), 0))
            buckets.append((bound, running))
        histograms[kind] = CumulativeHistogram(buckets, float(fields.get(f"{kind}:sum", 0.0)))
    return histograms
