"""`rlship doctor`: what a run needs, one line per check, with what to do when one fails.

The same checks `rlship run` makes before it starts anything (`orchestrator.commands.checks`), and
those it does not need itself: persistence, workers already answering on the queues (a run
on shared workers), the ports live runs hold. It changes nothing: no directory is made.
A run Redis holds (`--run-id R`, or its output directory) is checked with its stored
settings, as `rlship run --run-id R` would resume it; a finished or running run needs no
start, and is said to be in one line."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.commands.checks import doctor_checks
from orchestrator.commands.findings import Check
from orchestrator.commands.named_run import add_run_dir_argument, named_run
from orchestrator.resume import ResumeRefused
from orchestrator.settings_resolution import add_settings_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_dir_argument(parser)
    add_settings_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """Exit 1 when a check that would stop a run failed, else 0 (warnings included)."""
    run = named_run("doctor", args)
    run_id = run.given.settings.run_id
    if run.stored is not None and (run.stored.finished or run.stored.running):
        status = (
            "shows it; a new run needs another --run-id" if run.stored.finished else "--follow follows it"
        )
        print(f"run {run_id} is {run.stored.state()}: nothing to start, so nothing to check "
              f"(`rlship status {run_id}` {status})")  # fmt: skip
        return 0
    try:
        resolved = run.taken_up()
    except ResumeRefused as exc:
        raise SystemExit(f"rlship doctor: {exc}") from None
    settings = resolved.settings
    if resolved.sources["output_dir"] == "default":  # where `rlship run` would write: runs/{run id}
        settings = settings.with_changes(output_dir=Path("runs") / "RUN_ID")
    checks = doctor_checks(settings)
    if run.stored is not None:  # checked with the run's settings, as its resume would run
        resumes = f"`rlship run --run-id {run_id}` resumes it with its settings"
        checks.insert(0, Check("run", True, f"run {run_id} is {run.stored.state()}: {resumes}"))
    for check in checks:
        print(check.line())
    return 1 if any(not check.ok and check.fatal for check in checks) else 0
