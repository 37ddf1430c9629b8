"""`rlship` command line: run, trainer, produce, bench."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# Subcommand -> (module, description). Each module defines `add_arguments(parser)` and
# `main(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench encode": ("orchestrator.bench.encode", "encoder/decoder memory and speed, against msgpack and msgspec"),
}


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]]]:
    parser = argparse.ArgumentParser(prog="rlship", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    mains: dict[str, Callable[[argparse.Namespace], int]] = {}
    for name, (module_name, help_text) in COMMANDS.items():
        words = name.split()
        parent = commands
        for depth, word in enumerate(words[:-1]):
            group_name = " ".join(words[: depth + 1])
            if group_name not in groups:
                group_parser = parent.add_parser(word, help=f"{word} commands")
                groups[group_name] = group_parser.add_subparsers(dest=f"{word}_command", required=True)
            parent = groups[group_name]
        sub = parent.add_parser(words[-1], help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub)
        sub.set_defaults(_command=name)
        mains[name] = module.main
    return parser, mains


def main(argv: list[str] | None = None) -> int:
    parser, mains = _build_parser()
    args = parser.parse_args(argv)
    return mains[args._command](args)


if __name__ == "__main__":
    sys.exit(main())
