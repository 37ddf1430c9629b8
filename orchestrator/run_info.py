"""What a run is, as its orchestrator writes it to Redis when it starts: read by `rlship
status` and the Prometheus endpoint, which follow the run from other processes and know
only its id."""

from __future__ import annotations

from pathlib import Path

import redis
from pydantic import BaseModel

from orchestrator.settings import RunSettings
from transport.keys import RunKeys

# The run's info in its output directory too, so the files name their run (`rlship report`).
RUN_INFO_FILE = "run.json"


class RunInfo(BaseModel):
    run_id: str
    start_step: int
    steps: int
    ranks: int
    cpu_queue: str
    ship_queue: str
    output_dir: str

    @classmethod
    def from_settings(cls, settings: RunSettings) -> RunInfo:
        """The same-named settings, the output directory as text (as `RunInfo` is JSON)."""
        return cls(**settings.values_for(cls, output_dir=str(settings.output_dir)))

    def write_beside_outputs(self) -> None:
        """`run.json` in the output directory."""
        directory = Path(self.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / RUN_INFO_FILE).write_text(self.model_dump_json(indent=1))

    @classmethod
    def of_directory(cls, directory: Path) -> RunInfo | None:
        """The run whose output directory this is (its `run.json`), or None if it is not one."""
        try:
            return cls.model_validate_json((directory / RUN_INFO_FILE).read_text())
        except (OSError, ValueError):
            return None

    @property
    def queues(self) -> list[str]:
        return [self.cpu_queue, self.ship_queue]

    @classmethod
    def read(cls, client: redis.Redis, run_id: str) -> RunInfo | None:
        """The run's info, or None if Redis holds none (no orchestrator of it started)."""
        raw = client.get(RunKeys(run_id).info)
        return None if raw is None else cls.model_validate_json(raw)
