"""Celery's own account of a run's tasks, from the events its workers send
(`worker_send_task_events`): an oracle of how many deliveries started, independent of
what rlship counts itself."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from tasks.app import app


class TaskStarts:
    """Counts, per task name, the `task-started` events of the tasks whose arguments begin
    with the run's id (as `task-received` shows them), while started and not stopped."""

    def __init__(self, run_id: str) -> None:
        self.prefix = f"({run_id!r},"
        self.names: dict[str, str] = {}  # task id -> name, of the run's tasks
        self.started: Counter[str] = Counter()
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._capture, name="celery-events", daemon=True)

    def _on_event(self, event: dict[str, Any]) -> None:
        self.ready.set()  # the first event (the workers' answer to the wake-up): subscribed
        with self._lock:
            if event["type"] == "task-received" and str(event.get("args", "")).startswith(self.prefix):
                self.names[event["uuid"]] = event["name"]
            elif event["type"] == "task-started" and event["uuid"] in self.names:
                self.started[self.names[event["uuid"]]] += 1

    def _capture(self) -> None:
        with app.connection_for_read() as connection:
            self._receiver = app.events.Receiver(connection, handlers={"*": self._on_event})
            self._receiver.capture(limit=None, timeout=None, wakeup=True)

    def start(self) -> None:
        self._thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("no Celery event (the workers' heartbeat) within 30 s of subscribing")

    def counts(self) -> Counter[str]:
        with self._lock:
            return Counter(self.started)

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)
