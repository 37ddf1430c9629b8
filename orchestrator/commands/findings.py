"""What a check finds and how a command stops on it: a `Check` is one line naming what was
found and, for a failure, what to do; `require` turns the fatal failures into one line each
and exit status 2 (no traceback for an operator's mistake)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """One finding. `fix` says what to do when it failed; a failed `fatal` check stops a run."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    fatal: bool = True

    def line(self) -> str:
        mark = "ok  " if self.ok else ("FAIL" if self.fatal else "warn")
        return f"{mark} {self.name}: {self.detail}" + ("" if self.ok or not self.fix else f" -> {self.fix}")


class ChecksFailed(SystemExit):
    """A run that cannot start: the failed checks' lines, exit status 2."""

    def __init__(self, command: str, failed: list[Check]) -> None:
        lines = (f"rlship {command}: {check.detail}; {check.fix}" for check in failed)
        print("\n".join(lines), file=sys.stderr, flush=True)
        super().__init__(2)


def require(command: str, checks: Iterable[Check]) -> list[Check]:
    """The checks, or ChecksFailed naming every fatal failure among them."""
    checks = list(checks)
    failed = [check for check in checks if not check.ok and check.fatal]
    if failed:
        raise ChecksFailed(command, failed)
    return checks
