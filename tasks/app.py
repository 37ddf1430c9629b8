"""The Celery app: Redis as broker and result backend, msgpack/json only, late acks.

Start workers with `celery -A tasks worker -Q cpu` (compute stages) and
`celery -A tasks worker -Q ship -c 1 --prefetch-multiplier=1` (the one process that owns
the bound ZMQ sockets). With `RLSHIP_LOG_JSON=1` a worker logs JSON lines (`tasks.logs`).
"""

from __future__ import annotations

import contextlib
import os

from celery import Celery

from tasks import logs  # noqa: F401  (connects the worker logging hooks)
from transport.connection import celery_redis_options

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CPU_QUEUE = "cpu"
SHIP_QUEUE = "ship"
VISIBILITY_TIMEOUT_ENV = "RLSHIP_VISIBILITY_TIMEOUT"


def visibility_timeout() -> int:
    """Seconds before an unacknowledged task is delivered again. Every stage task is short
    (long waits are retries, not sleeps), so a few minutes bounds the recovery delay of a
    killed worker without re-running live tasks."""
    return int(os.environ.get(VISIBILITY_TIMEOUT_ENV, "300"))


_environment_url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
app = Celery("rlship", include=["tasks.ship"])
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
