"""metrics.jsonl as a restarted orchestrator finds it: a writer SIGKILLed in the middle of a
line of several pages leaves it cut at a page (the kernel stops the write there); the next
orchestrator must not append to it, and writes that record again whole."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.monitors import JsonlMonitor


def record(step: int, width: int = 10_000) -> dict[str, float]:
    """A record whose line spans several pages, as a run's records with many envs do."""
    return {"step": float(step), **{f"metric/{i:05d}": float(i) for i in range(width // 20)}}


def lines(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_line_cut_at_a_page_is_dropped_and_its_record_written_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    whole = (json.dumps(record(0), sort_keys=True) + "\n").encode()
    torn = (json.dumps(record(1), sort_keys=True) + "\n").encode()[:8192]
    path.write_bytes(whole + torn)
    monitor = JsonlMonitor(path)
    monitor.log(record(0))  # logged already: skipped
    monitor.log(record(1))
    monitor.log(record(2))
    monitor.close()
    assert [line["step"] for line in lines(path)] == [0.0, 1.0, 2.0]
    assert lines(path)[1] == record(1)


def test_a_file_of_one_torn_line_starts_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes((json.dumps(record(0), sort_keys=True) + "\n").encode()[:4096])
    monitor = JsonlMonitor(path)
    monitor.log(record(0))
    monitor.close()
    assert lines(path) == [record(0)]


def test_whole_lines_are_kept_as_they_are(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    kept = "".join(json.dumps(record(step, 100), sort_keys=True) + "\n" for step in range(3))
    path.write_text(kept)
    JsonlMonitor(path).close()
    assert path.read_text() == kept
