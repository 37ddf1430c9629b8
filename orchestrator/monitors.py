"""Monitors: where each published record goes besides the Redis stream that the
finalizer writes (`rlship:{run_id}:metrics`, the source of truth a dashboard can follow).

The orchestrator follows that stream and hands every record to its monitors, on a thread
of their own so that file and network I/O never run on the event loop: a JSONL file
(`{output_dir}/metrics.jsonl`, always) and Weights & Biases when a project is configured
(`--wandb-project`; offline mode by default, which needs no network), with `step` as the
x-axis of every chart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

from orchestrator.settings import RunSettings
from transport.run_files import space_for


class Monitor(Protocol):
    def log(self, record: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlMonitor:
    """Appends one line per record. A restarted orchestrator may hand it again a record it
    wrote just before dying; steps at or below the file's last one are skipped. A line the
    disk has no room for is taken back whole and raises `DiskFull` (the run stops; resumed,
    it writes the line again)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        drop_torn_line(path)
        self._last_step = last_logged_step(path)
        self._sink = path.open("ab", buffering=0)

    def log(self, record: dict[str, float]) -> None:
        if record["step"] <= self._last_step:
            return
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        end = self._sink.seek(0, os.SEEK_END)
        with space_for(self.path, len(line)):
            try:
                written = 0
                while written < len(line):
                    written += self._sink.write(line[written:]) or 0
            except OSError:
                self._sink.truncate(end)
                raise
        self._last_step = record["step"]

    def close(self) -> None:
        self._sink.close()


def drop_torn_line(path: Path, tail_bytes: int = 1 << 20) -> None:
    """Cut a last line left without its newline: the kernel may stop a write of several pages
    at a page when the writer is killed (SIGKILL), and what is appended next would join it.
    Its record is written again whole, as the step is not logged."""
    if not path.exists():
        return
    with path.open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - tail_bytes)
        f.seek(start)
        tail = f.read()
        if not tail or tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n")
        if cut >= 0 or start == 0:
            f.truncate(start + cut + 1)


def last_logged_step(path: Path, tail_bytes: int = 1 << 20) -> float:
    """The step of the last complete line of a metrics.jsonl (-1 if none), read from its tail."""
    if not path.exists():
        return -1
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, 2) - tail_bytes))
        lines = f.read().split(b"\n")
    for line in reversed(lines):
        try:
            return float(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return -1


class WandbMonitor:
    def __init__(self, settings: RunSettings) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise SystemExit(
                f"rlship: wandb_project={settings.wandb_project!r} is set but wandb is not installed "
                "(pip install -e '.[wandb]' in the checkout)"
            ) from exc
        self._run: Any = wandb.init(
            project=settings.wandb_project,
            name=settings.run_id,
            id=settings.run_id,
            resume="allow",
            mode=settings.wandb_mode,
            dir=str(settings.output_dir),
            config=settings.model_dump(mode="json", exclude={"redis_url"}),
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log(self, record: dict[str, float]) -> None:
        self._run.log(record)

    def close(self) -> None:
        self._run.finish()


class Monitors:
    """Every configured monitor, as one."""

    def __init__(self, settings: RunSettings) -> None:
        self.monitors: list[Monitor] = [JsonlMonitor(Path(settings.output_dir) / "metrics.jsonl")]
        if settings.wandb_project:
            self.monitors.append(WandbMonitor(settings))

    def log(self, record: dict[str, float]) -> None:
        for monitor in self.monitors:
            monitor.log(record)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
