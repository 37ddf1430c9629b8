"""`rlship doctor`: what a run needs, one line per check, with what to do when one fails.

The same checks `rlship run` makes before it starts anything (`orchestrator.commands.checks`), and
those it does not need itself: persistence, Chromium for the browser test, workers already
answering on the queues (a run on shared workers)."""

from __future__ import annotations

import argparse

from orchestrator.commands.checks import doctor_checks
from orchestrator.settings_resolution import add_settings_arguments, settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """Exit 1 when a check that would stop a run failed, else 0 (warnings included)."""
    checks = doctor_checks(settings_from_args(args))
    for check in checks:
        print(check.line())
    return 1 if any(not check.ok and check.fatal for check in checks) else 0
