"""`rlship bench tracing`: what tracing costs a stage task, measured on its own (BENCHMARKS.md,
"Tracing"): CPU seconds of a process that runs `--tasks` tasks through `tasks.tracing`'s own
handlers (the task's span, a send span inside it, the span's end and its export), with the
spans sent to a local OTLP/HTTP receiver that discards (`otlp_sink`, in this process: a
collector's CPU is not the ship path's). Each mode runs in a fresh process, `--rounds` times,
alternating:

- `task-end`: the default, each task's spans exported when it ends (one request a task);
- `timer`: `OTEL_BSP_SCHEDULE_DELAY` set, the SDK's batch processor on its timer.

The process's CPU includes its export thread. Per step: the CPU a task times the stage
tasks of a step at `--ranks` (4 + 2 x ranks + 2: finalize, prune, metrics, pack, encode and
send per rank, publish, release).

    rlship bench tracing --tasks 2000 --rounds 3 --ranks 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from orchestrator.commands.bench.otlp_sink import OtlpSink

MODES = {"task-end": {}, "timer": {"OTEL_BSP_SCHEDULE_DELAY": "5000"}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", type=int, default=2000, help="stage tasks a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode, alternating")
    parser.add_argument(
        "--ranks", type=int, default=8, help="for the per-step figure: 4 + 2 x ranks + 2 tasks"
    )


def run_tasks(count: int) -> float:
    """In the measured process: `count` encode tasks through the handlers; CPU seconds a task."""
    from celery.app.task import Context

    from tasks import tracing
    from tasks.tracing_sdk import Tracing

    class Task:
        name = "rlship.send"

    def one(task: Task, index: int) -> None:
        task.request = Context(
            id=f"task-{index}",
            retries=0,
            delivery_info={"redelivered": False},
            hostname="bench@host",
            traceparent=f"00-{index + 1:032x}-{index + 1:016x}-01",
        )
        tracing._start(task_id=task.request.id, task=task, args=["bench", index, 0])
        with tracing.span("rlship.zmq_send", **{"rlship.step": index, "rlship.rank": 0}):
            pass
        tracing._end(task_id=task.request.id, state="SUCCESS")

    tracing._worker_tracing = True  # as `connect_celery` sets it in a worker
    task = Task()
    one(task, 0)  # the set-up (SDK, exporter's connection) is not a task's
    started = time.process_time()
    for index in range(1, count + 1):
        one(task, index)
    found: Tracing = tracing.tracing("worker")
    found.provider.force_flush()
    return (time.process_time() - started) / count


def main(args: argparse.Namespace) -> int:
    if args.tasks < 1 or args.rounds < 1:
        raise SystemExit("rlship: --tasks and --rounds must be >= 1")
    sink = OtlpSink()
    per_task: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for _ in range(args.rounds):
            for mode, env in MODES.items():
                child_env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, **env}
                if not env:
                    child_env.pop("OTEL_BSP_SCHEDULE_DELAY", None)
                code = f"from {__name__} import run_tasks; print(run_tasks({args.tasks}))"
                done = subprocess.run(
                    [sys.executable, "-c", code], env=child_env, capture_output=True, text=True, check=True
                )
                per_task[mode].append(float(done.stdout.strip().splitlines()[-1]))
    finally:
        received = sink.stop()
    tasks_a_step = 4 + 2 * args.ranks + 2
    report = {
        "command": f"rlship bench tracing --tasks {args.tasks} --rounds {args.rounds} --ranks {args.ranks}",
        "cpu_ms_per_task": {
            mode: [round(s * 1000, 4) for s in seconds] for mode, seconds in per_task.items()
        },
        "tasks_a_step": tasks_a_step,
        "otlp_received": received,
    }
    for mode, seconds in per_task.items():
        median = statistics.median(seconds) * 1000
        rounds = ", ".join(f"{s * 1000:.3f}" for s in seconds)
        print(
            f"{mode}: {median:.3f} ms of CPU a task (median of {rounds}); "
            f"{median * tasks_a_step:.1f} ms a step of {tasks_a_step} stage tasks ({args.ranks} ranks)"
        )
    print(json.dumps(report))
    return 0
