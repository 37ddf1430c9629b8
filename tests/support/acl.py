"""The users of a run's roles on a test's own Redis, made as an operator makes them: from
`rlship acl --run R`'s lines, each role's USER:PASSWORD in `RLSHIP_REDIS_{ROLE}_AUTH`."""

from __future__ import annotations

import os
import subprocess

import redis

from orchestrator.settings import ROLES
from tests.support.processes import REPO, python_command


def role_auth(run_id: str) -> dict[str, str]:
    """Each role's `RLSHIP_REDIS_{ROLE}_AUTH` for `run_id`: a user and password of its own."""
    return {f"RLSHIP_REDIS_{role.upper()}_AUTH": f"{role}-{run_id}:pw-{role}-{run_id}" for role in ROLES}


def acl_lines(run_id: str, *flags: str) -> list[list[str]]:
    """`rlship acl --run`'s lines for the run, each split into a command's words."""
    done = subprocess.run(
        python_command("acl", "--run", run_id, *flags),
        env={**os.environ, **role_auth(run_id), "PYTHONPATH": str(REPO)},
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert f"pw-producer-{run_id}" not in done.stdout  # passwords only by hash
    return [line.split() for line in done.stdout.splitlines()]


def make_users(admin: redis.Redis, run_id: str, *flags: str) -> None:
    """The run's users, made from `rlship acl --run`'s lines as an operator would."""
    for line in acl_lines(run_id, *flags):
        assert admin.execute_command(*line) in (b"OK", "OK")
