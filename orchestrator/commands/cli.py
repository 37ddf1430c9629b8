"""`rlship`: the command line. Each command is a module of `orchestrator.commands` with an
`add_arguments(parser)` and a `main(args)`; this module finds the command, imports it,
parses its arguments and turns what no command foresaw into one line (secrets masked)."""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import redis
from pydantic import ValidationError

from orchestrator.settings_resolution import validation_problems
from tasks.logs import mask_secrets

CommandEntry = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int | None]]

# Subcommand -> what it does (its --help description); `load_command` imports it.
COMMANDS: dict[str, str] = {
    "run": "the whole system on this machine: Redis, workers, trainer ranks, producer, orchestrator",
    "orchestrate": "the orchestrator alone (what `run` starts)",
    "trainer": "one reference trainer rank: receive, check, acknowledge each step",
    "produce": "the synthetic rollout producer",
    "keys": "a run's CURVE key pairs for --zmq-curve (ship worker's, one per rank) and where each goes",
    "bench encode": "encoder/decoder memory and speed, against msgpack and msgspec",
    "bench loop": "event-loop lag while shipping: stages inline, in threads, in Celery workers",
    "bench curve": "what CURVE costs the ZMQ transport: sender and ranks' CPU a step, plain and with CURVE",
    "bench tracing": "what tracing costs a stage task: its spans and their export, per task and per step",
    "bench episodes": "a producer's CPU for verifiers episodes against plain rollouts of the same tokens",
    "bench mock-inference": "a mock OpenAI-compatible inference server: streamed answers at a set pace",
    "config show": "the effective settings (environment < --config TOML < flags), or a run's stored ones",
    "config table": "every setting (flag, variable, default, description) as a Markdown table",
    "chaos": "a seeded run while its workers and orchestrator are killed, against a fault-free one",
    "status": "a run's status from another terminal (--follow: live); without RUN_ID, the runs Redis holds",
    "doctor": "what a run needs (Redis, password, eviction, ports, output dir, workers): one line each",
    "report": "report.html and PNG charts of a run from its metrics.jsonl",
    "acl": "the ACL rules (ACL SETUSER lines) of a run's producer, workers, orchestrator and trainer ranks",
}


def load_command(name: str) -> CommandEntry:
    """The command's argument-adding and main functions. Imported only when the command
    runs: a command of an optional extra must not stop the others, and start-up stays quick."""
    match name:
        case "run":
            from orchestrator.commands.run import add_arguments, main
        case "orchestrate":
            from orchestrator.commands.orchestrate import add_arguments, main
        case "trainer":
            from orchestrator.commands.trainer import add_arguments, main
        case "produce":
            from orchestrator.commands.produce import add_arguments, main
        case "keys":
            from orchestrator.commands.keys import add_arguments, main
        case "bench encode":
            from orchestrator.commands.bench.encode import add_arguments, main
        case "bench loop":
            from orchestrator.commands.bench.loop import add_arguments, main
        case "bench curve":
            from orchestrator.commands.bench.curve import add_arguments, main
        case "bench tracing":
            from orchestrator.commands.bench.tracing import add_arguments, main
        case "bench episodes":
            from orchestrator.commands.bench.episodes import add_arguments, main
        case "bench mock-inference":
            from orchestrator.commands.bench.mock_inference import add_arguments, main
        case "config show":
            from orchestrator.commands.config import add_arguments, main
        case "config table":
            from orchestrator.commands.config import add_table_arguments as add_arguments
            from orchestrator.commands.config import table_main as main
        case "chaos":
            from orchestrator.commands.chaos import add_arguments, main
        case "status":
            from orchestrator.commands.status import add_arguments, main
        case "doctor":
            from orchestrator.commands.doctor import add_arguments, main
        case "report":
            from orchestrator.commands.report import add_arguments, main
        case "acl":
            from orchestrator.commands.acl import add_arguments, main
        case _:
            raise KeyError(name)
    return add_arguments, main


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  rlship {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    return "usage: rlship COMMAND [options]   (rlship COMMAND --help for its options)\n\n" + "\n".join(lines)


def version() -> str:
    try:
        return importlib.metadata.version("rlship")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the longest command matching the arguments; import only its module.
    Whatever the command prints on its way out (an error, a traceback) has passwords masked."""
    argv = sys.argv[1:] if argv is None else argv
    for name in sorted(COMMANDS, key=lambda n: -len(n.split())):
        words = name.split()
        if argv[: len(words)] == words:
            return run_command(name, argv[len(words) :])
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and argv[0] == "--version":
        print(f"rlship {version()}")
        return 0
    if argv:
        groups = {name.split()[0] for name in COMMANDS if " " in name}  # bench, config
        given = " ".join(argv[:2] if argv[0] in groups else argv[:1])
        print(f"rlship: unknown command {given!r} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
    else:
        print(usage(), file=sys.stderr)
    return 2


def extras_installing(package: str) -> list[str]:
    """The extras of rlship (its installed metadata) that install `package`, `test` last."""
    try:
        requirements = importlib.metadata.requires("rlship") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    extras = []
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        installed = re.split(r"[\s<>=!~\[]", name.strip(), maxsplit=1)[0]
        if installed.lower() == package.lower() and "extra" in marker:
            extras.append(marker.split("==")[-1].strip().strip("\"'"))
    return sorted(extras, key=lambda extra: extra == "test")


class CommandParser(argparse.ArgumentParser):
    """A command's parser. No abbreviations (`allow_abbrev=False`): `--step 1` is refused,
    not taken as `--steps 1`, and a flag added later cannot change what a prefix meant. A
    wrong argument ends in one line naming it (and the closest option), not the usage."""

    def error(self, message: str) -> NoReturn:
        given = re.match(r"unrecognized arguments: (-[^\s=]+)", message)
        close = difflib.get_close_matches(given[1], self._option_string_actions, n=1) if given else []
        hint = f" (did you mean {close[0]}?)" if close else f" (`{self.prog} --help` lists the options)"
        self.exit(2, f"{self.prog}: {message}{hint}\n")


def command_parser(name: str, **options: Any) -> argparse.ArgumentParser:
    return CommandParser(prog=f"rlship {name}", description=COMMANDS[name], allow_abbrev=False, **options)


def run_command(name: str, argv: list[str]) -> int:
    parser = command_parser(name)
    try:
        add_arguments, command_main = load_command(name)
    except ModuleNotFoundError as exc:
        extras = extras_installing(exc.name or "")
        install = f"pip install -e '.[{extras[0]}]'" if extras else "see the README's quick start"
        print(f"rlship {name}: needs the Python package {exc.name!r}: {install}", file=sys.stderr)
        return 2
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return int(command_main(args) or 0)
    except SystemExit as exc:
        if isinstance(exc.code, str):  # a command that stops with a message: what it was given is wrong
            print(mask_secrets(exc.code), file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:  # Ctrl-C: a stop asked for, not a failure to show a traceback of
        print(f"rlship {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `rlship ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 1
    except redis.exceptions.NoPermissionError as exc:  # an ACL user's rules (`rlship acl`) refused it
        print(
            f"rlship {name}: Redis refused it (NOPERM): {exc}: the user it connects as is another run's "
            "or another role's (check --run-id and redis_*_auth)",
            file=sys.stderr,
        )
        return 3
    except redis.RedisError as exc:
        # What the commands' own checks did not foresee: still one line, no traceback.
        print(mask_secrets(f"rlship {name}: Redis: {type(exc).__name__}: {exc}"), file=sys.stderr)
        return 3
    except OSError as exc:
        print(mask_secrets(f"rlship {name}: {exc}"), file=sys.stderr)
        return 1
    except ValidationError as exc:  # settings built past `resolve_settings`
        print(f"rlship {name}: invalid setting: {validation_problems(exc, {})}", file=sys.stderr)
        return 2
    except Exception:
        print(mask_secrets(traceback.format_exc()), file=sys.stderr, end="")
        return 1


if __name__ == "__main__":
    sys.exit(main())
