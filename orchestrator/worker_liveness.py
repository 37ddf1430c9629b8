"""Which workers consume a run's queues and answer, for its Prometheus endpoint: asked on a
thread of its own every `interval` seconds (a Celery inspect waits its whole timeout for
replies), so that a scrape only reads the last answer and stays fast."""

from __future__ import annotations

import logging
import threading

from orchestrator.run_info import RunInfo
from orchestrator.worker_queries import queue_consumers

log = logging.getLogger("rlship.orchestrator")

REFRESH_SECONDS = 10.0
REPLY_TIMEOUT_SECONDS = 1.0


class WorkerLiveness:
    """The number of answering workers per queue kind (`cpu`, `ship`), refreshed in the
    background; `counts` is empty until the first answer."""

    def __init__(self, redis_url: str, info: RunInfo, interval: float = REFRESH_SECONDS) -> None:
        self.redis_url = redis_url
        self.kinds = {info.cpu_queue: "cpu", info.ship_queue: "ship"}
        self.interval = interval
        self.counts: dict[str, int] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="rlship-worker-liveness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stopping.is_set():
            try:
                consumers = queue_consumers(self.redis_url, list(self.kinds), timeout=REPLY_TIMEOUT_SECONDS)
                self.counts = {self.kinds[queue]: len(names) for queue, names in consumers.items()}
            except Exception as exc:  # a broker that does not answer: no worker can take a task
                log.warning("cannot ask the workers which consume the run's queues: %s", exc)
                self.counts = dict.fromkeys(self.kinds.values(), 0)
            self._stopping.wait(self.interval)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=REPLY_TIMEOUT_SECONDS + 5)
