"""`rlship acl`: the ACL rules of a run's roles, one `ACL SETUSER` line each, for an operator
to give Redis (`rlship acl --run R | redis-cli --user admin --askpass`). Nothing is sent to
Redis, and passwords appear only as their SHA-256 (`orchestrator.acl`)."""

from __future__ import annotations

import argparse
import sys

from orchestrator.acl import acl_rules, role_user
from orchestrator.settings import ROLES
from orchestrator.settings_resolution import add_settings_arguments, settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", dest="run_id", default=None, metavar="RUN_ID", help="the run (as --run-id)")
    add_settings_arguments(parser)


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    for role in ROLES:
        user = role_user(settings, role)
        if user.password is None:
            print(
                f"rlship acl: {role}: user {user.name} has no password (set redis_{role}_auth to "
                f"USER:PASSWORD, or give it one: ACL SETUSER {user.name} >PASSWORD)",
                file=sys.stderr,
            )
    print("\n".join(acl_rules(settings)))
    return 0
