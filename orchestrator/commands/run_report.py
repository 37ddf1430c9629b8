"""What `rlship run` says when it ends: its summary, from Redis (the one source whatever
stopped the run), printed and written as JSON (`--summary-json`).

Its times: `run_seconds`, from the start of `rlship run` to the end of its shipping (the
time it prints); `wall_seconds`, the whole command, stop included; `orchestrator_seconds`,
the orchestrator's own run (from its summary, when it finished)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis

from orchestrator.settings import RunSettings
from tasks.stages.record_names import total_shipped_tokens
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys

KEYS_KEPT_SECONDS = DEFAULT_TTL_SECONDS


def received_by_rank(client: redis.Redis, run_id: str, ranks: int) -> dict[str, dict[str, Any]]:
    """What each trainer rank recorded as received: its steps in order, their checksums, and
    the checksums of the side-array rows it read by handle (by step)."""
    keys = RunKeys(run_id)
    out = {}
    for rank in range(ranks):
        received = {int(k): v.decode() for k, v in client.hgetall(keys.received(rank)).items()}
        steps = sorted(received)
        rows = {k.decode(): v.decode() for k, v in client.hgetall(keys.received_rows(rank)).items()}
        out[str(rank)] = {"steps": steps, "checksums": [received[s] for s in steps], "rows_checksums": rows}
    return out


def sent_checksums(client: redis.Redis, run_id: str, key: str | None = None) -> dict[str, str]:
    """`{step}:{rank}` to the checksum encode wrote: of the payload, or of another hash (`key`)."""
    return {k.decode(): v.decode() for k, v in client.hgetall(key or RunKeys(run_id).sent_checksums).items()}


def orchestrator_error(log_path: Path) -> str:
    """`: {cause}` from the orchestrator's last error line (`rlship orchestrate: ...`), if any."""
    prefix = "rlship orchestrate: "
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    causes = [line.removeprefix(prefix) for line in lines if line.startswith(prefix)]
    return f": {causes[-1]}" if causes else ""


def summarize(
    client: redis.Redis, settings: RunSettings, orchestrator_summary: Path, stopped: str, shipped_before: int
) -> dict[str, Any]:
    """What the run shipped: a step is shipped when its record is published, which needs
    every rank's send first. `resumable`: its orchestrator stored the run's settings and it
    did not finish, so `rlship run --run-id` resumes it."""
    keys = RunKeys(settings.run_id)
    shipped = int(client.hlen(keys.published))
    summary: dict[str, Any] = {"run_id": settings.run_id}
    if orchestrator_summary.exists():
        summary.update(json.loads(orchestrator_summary.read_text()))
    stream = client.xrange(keys.metrics_stream)  # the last RECORDS_KEPT
    records = [json.loads(fields[b"record"]) for _, fields in stream]
    lag_ms = [record.get("event_loop_lag/max_ms", 0.0) for record in records]
    summary.update(
        {
            "tokens_shipped": int(total_shipped_tokens(records[-1])) if records else 0,
            "loop_lag_max_ms": max([summary.get("loop_lag_max_ms", 0.0), *lag_ms]),
            "steps_wanted": settings.steps,
            "steps_shipped": shipped,
            "steps_shipped_before": shipped_before,
            "stopped": stopped,
            "resumable": bool(client.exists(keys.settings)) and not client.exists(keys.finished),
            "ranks": received_by_rank(client, settings.run_id, settings.ranks),
            "sent_checksums": sent_checksums(client, settings.run_id),
            "sent_rows_checksums": sent_checksums(client, settings.run_id, keys.sent_rows_checksums),
            "tasks_dropped": _counts(client, keys.tasks_dropped),
            "served_by": _counts(client, keys.served_by),
            "foreign_dropped": _counts(client, keys.foreign_dropped),
            "zmq_port": settings.zmq_port if settings.transport == "zmq" else None,
        }
    )
    return summary


def _counts(client: redis.Redis, key: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(key).items()}


def steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def print_summary(summary: dict[str, Any]) -> None:
    run_id = summary["run_id"]
    before = summary.get("steps_shipped_before", 0)
    resumed = f", {before} of them before this start" if before else ""
    print(
        f"\nrlship run {run_id}: {steps(summary['steps_shipped'])} shipped{resumed}, "
        f"{summary.get('tokens_shipped', 0):,} tokens in "
        f"{summary['run_seconds']:.1f} s; event-loop lag max {summary.get('loop_lag_max_ms', 0.0):.1f} ms"
    )
    for rank, received in sorted(summary.get("ranks", {}).items()):
        print(f"  rank {rank}: received steps {received['steps']}")
    for rank, dropped in sorted(summary.get("foreign_dropped", {}).items()):
        print(f"  rank {rank}: dropped {dropped} steps of another run (pointed at another run's port)")
    if summary.get("tasks_dropped"):
        print(f"  tasks dropped after the run ended (not retried): {summary['tasks_dropped']}")
    if summary["stopped"] != "done":
        kept = f"the run's keys expire in {KEYS_KEPT_SECONDS // 3600} h"
        again = (
            f"`rlship run --run-id {run_id}` resumes it with its settings"
            if summary["resumable"]
            else "its orchestrator had not stored its settings: the same command starts it again"
        )
        print(
            f"  stopped: {summary['stopped']}, {summary['steps_wanted'] - summary['steps_shipped']} of "
            f"{summary['steps_wanted']} steps not shipped; {kept}: {again}"
        )
