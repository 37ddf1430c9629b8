"""Questions to a run's Celery workers, over its broker: which answer, which consume a queue.

Each question uses a Celery app of its own, made for the broker asked: the shared app's
broker is fixed when `tasks` is imported. Blocking calls (Celery's control replies): run
them off the event loop.
"""

from __future__ import annotations

from typing import Any

from transport.connection import celery_redis_options


def _control_app(name: str, redis_url: str) -> Any:
    """A Celery app of its own on the broker at `redis_url` (Sentinels included). It only
    reads replies, unacknowledged, so kombu's emulation of acknowledgements is off: with it,
    consuming the replies made kombu restore the server's unacknowledged messages (its
    `unacked_mutex`, a key only the workers' ACL user may touch), and the orchestrator's
    user was refused its stall diagnosis (NOPERM, logged as "Redis does not answer")."""
    from celery import Celery

    options = celery_redis_options(redis_url)
    transport = {**options.get("broker_transport_options", {}), "ack_emulation": False}
    app = Celery(name)
    app.conf.update(options, broker_transport_options=transport, accept_content=["msgpack", "json"])
    return app


def answering_workers(redis_url: str, timeout: float = 0.5) -> set[str]:
    """The names of the workers on `redis_url` that answer a ping: they consume their queues.
    An app of its own, because the shared app's broker is fixed when it is imported."""
    ping_app = _control_app("rlship-ping", redis_url)
    return {name for reply in ping_app.control.ping(timeout=timeout) or [] for name in reply}


def queue_consumers(redis_url: str, queues: list[str], timeout: float = 1.0) -> dict[str, list[str]]:
    """Per queue, the names of the workers that answer and consume it."""
    inspect_app = _control_app("rlship-inspect", redis_url)
    replies = inspect_app.control.inspect(timeout=timeout).active_queues() or {}
    consumed = {worker: {q["name"] for q in worker_queues} for worker, worker_queues in replies.items()}
    return {queue: sorted(w for w, names in consumed.items() if queue in names) for queue in queues}
