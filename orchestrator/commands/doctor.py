"""`rlship doctor`: what a run needs, one line per check, with what to do when one fails.

The same checks `rlship run` makes before it starts anything (`orchestrator.commands.checks`), and
those it does not need itself: persistence, workers already answering on the queues (a run
on shared workers), the ports live runs hold. It changes nothing: no directory is made."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.commands.checks import doctor_checks
from orchestrator.settings_resolution import add_settings_arguments, resolve_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """Exit 1 when a check that would stop a run failed, else 0 (warnings included)."""
    resolved = resolve_settings(args)
    settings = resolved.settings
    if resolved.sources["output_dir"] == "default":  # where `rlship run` would write: runs/{run id}
        settings = settings.with_changes(output_dir=Path("runs") / "RUN_ID")
    checks = doctor_checks(settings)
    for check in checks:
        print(check.line())
    return 1 if any(not check.ok and check.fatal for check in checks) else 0
