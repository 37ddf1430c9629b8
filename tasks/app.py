"""The Celery app: Redis as broker and result backend, msgpack/json only, late acks.

Start workers with `celery -A tasks worker -Q cpu` (compute stages) and
`celery -A tasks worker -Q ship -c 1 --prefetch-multiplier=1` (the one process that owns
the bound ZMQ sockets). With `RLSHIP_LOG_JSON=1` a worker logs JSON lines (`tasks.logs`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from celery import Celery, signals
from celery.app.amqp import AMQP, Queues
from kombu import Queue

from tasks import logs, tracing  # noqa: F401  (logs connects the worker logging hooks)
from transport.connection import celery_redis_options, with_credentials
from transport.keys import DEFAULT_TTL_SECONDS, is_run_queue, queue_traces
from transport.task_metrics import stamp_enqueue_time

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CPU_QUEUE = "cpu"
SHIP_QUEUE = "ship"
VISIBILITY_TIMEOUT_ENV = "RLSHIP_VISIBILITY_TIMEOUT"
WORKER_AUTH_ENV = "RLSHIP_REDIS_WORKER_AUTH"


def visibility_timeout() -> int:
    """Seconds before an unacknowledged task is delivered again. Every stage task is short
    (long waits are retries, not sleeps; a send stays for its step's encodes at most
    `tasks.send.STAY_SECONDS`), so a few minutes bounds the recovery delay of a killed
    worker without re-running live tasks."""
    return int(os.environ.get(VISIBILITY_TIMEOUT_ENV, "300"))


class RunQueues(Queues):
    """A run's own queue (`transport.keys.run_queue`) is declared to expire (kombu's
    x-expires) `DEFAULT_TTL_SECONDS` after its last put or get, and its binding table is
    swept by kombu's consumers twice that after its last refresh: however a run stops, its
    queues do not stay in Redis for ever. A queue an operator names is Celery's as before."""

    def new_missing(self, name: str) -> Queue:
        queue = super().new_missing(name)
        if is_run_queue(name):
            queue.expires = DEFAULT_TTL_SECONDS
        return queue


class RunAMQP(AMQP):
    queues_cls = RunQueues


@signals.worker_ready.connect
@signals.worker_shutdown.connect
def expire_run_queues(sender: Any, **_: Any) -> None:
    """The run's own queues this worker consumes expire, however the run stops: kombu gives
    the binding tables it made at start-up no expiry, and a stopping worker puts the
    messages it held (a retry's countdown) back on their queue without one. The run's lease
    renews them with its other keys while it lives (`transport.store.expire_run`)."""
    queues = [queue.name for queue in sender.app.amqp.queues.consume_from.values()]
    with sender.app.connection_for_write() as connection:
        client = connection.default_channel.client
        for key in [key for queue in filter(is_run_queue, queues) for key in queue_traces(queue)]:
            client.expire(key, DEFAULT_TTL_SECONDS, nx=True)
            client.expire(key, DEFAULT_TTL_SECONDS, gt=True)


# Every task message, whichever process publishes it, carries its enqueue time (the queue wait).
signals.before_task_publish.connect(stamp_enqueue_time)


# A worker connects as its role's user when it has one (the setting `redis_worker_auth`).
_environment_url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
if os.environ.get(WORKER_AUTH_ENV):
    _environment_url = with_credentials(_environment_url, os.environ[WORKER_AUTH_ENV])
app = Celery("rlship", include=["tasks.ship"], amqp=RunAMQP)
app.conf.update(
    task_serializer="msgpack",
    result_serializer="msgpack",
    accept_content=["msgpack", "json"],
    result_accept_content=["msgpack", "json"],
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=CPU_QUEUE,
    task_routes={"rlship.send": {"queue": SHIP_QUEUE}},
    worker_send_task_events=True,
    task_send_sent_event=True,
    broker_connection_retry_on_startup=True,
    # A stage enqueues its successors itself: if that publish gave up during a Redis
    # restart, the step would stop there. Keep trying for about as long as the Redis
    # clients do (transport.connection.OUTAGE_SECONDS).
    task_publish_retry=True,
    task_publish_retry_policy={
        "max_retries": 40,
        "interval_start": 0.1,
        "interval_step": 0.5,
        "interval_max": 1.0,
    },
    worker_hijack_root_logger=False,
)


if tracing.enabled():
    # A worker that cannot trace says so in one line and ships untraced.
    if (_tracing_problem := tracing.problem()) is not None:
        tracing.log.error("rlship: tracing off: %s", _tracing_problem)
    else:
        tracing.connect_celery(signals)


def use_redis(url: str) -> None:
    """Point the broker and the result backend at `url` (with Sentinels: at the primary
    they name, followed through a failover). The app is built when this module is
    imported, from REDIS_URL, before a command has read its flags and `--config` file; the
    orchestrator calls this with the URL its settings resolved, so the tasks it enqueues go
    to the Redis its keys are on. Call it before the first publish: a connection pool, once
    made, stays."""
    options = celery_redis_options(url)
    for name in ("broker_transport_options", "result_backend_transport_options"):
        options[name] = {**options.get(name, {}), "visibility_timeout": visibility_timeout()}
    app.conf.update(options)
    global _redis_url
    _redis_url = url


_redis_url = _environment_url
with contextlib.suppress(ValueError):  # a malformed REDIS_URL is named by the settings' check
    use_redis(_environment_url)


def redis_url() -> str:
    """The Redis this process's clients use (REDIS_URL in a worker)."""
    return _redis_url
