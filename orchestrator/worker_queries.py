"""Questions to a run's Celery workers, over its broker: which answer, which consume a queue.

Each question uses a Celery app of its own, made for the broker asked: the shared app's
broker is fixed when `tasks` is imported. Blocking calls (Celery's control replies): run
them off the event loop.
"""

from __future__ import annotations


def answering_workers(redis_url: str, timeout: float = 0.5) -> set[str]:
    """The names of the workers on `redis_url` that answer a ping: they consume their queues.
    An app of its own, because the shared app's broker is fixed when it is imported."""
    from celery import Celery

    ping_app = Celery("rlship-ping", broker=redis_url)
    ping_app.conf.accept_content = ["msgpack", "json"]
    return {name for reply in ping_app.control.ping(timeout=timeout) or [] for name in reply}


def queue_consumers(redis_url: str, queues: list[str], timeout: float = 1.0) -> dict[str, list[str]]:
    """Per queue, the names of the workers that answer and consume it."""
    from celery import Celery

    inspect_app = Celery("rlship-inspect", broker=redis_url)
    inspect_app.conf.accept_content = ["msgpack", "json"]
    replies = inspect_app.control.inspect(timeout=timeout).active_queues() or {}
    consumed = {worker: {q["name"] for q in worker_queues} for worker, worker_queues in replies.items()}
    return {queue: sorted(w for w, names in consumed.items() if queue in names) for queue in queues}
