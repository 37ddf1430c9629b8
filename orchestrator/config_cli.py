"""`rlship config show`: the effective settings, and where each value came from.

Takes the same `--config` file and flags as every other command, so an operator sees what
`rlship run` would run with before starting it. The default output is TOML (secrets
masked) that `--config` reads back; `--json` prints the values alone as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from orchestrator.settings import ResolvedSettings, add_settings_arguments, resolve_settings, shown_value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the values as one JSON object")


def toml_value(value: Any) -> str:
    """A TOML literal: JSON's string escapes are TOML's, and so are its numbers."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value) if isinstance(value, Path) else value)


def shown_settings(resolved: ResolvedSettings) -> dict[str, Any]:
    values = resolved.settings.model_dump(mode="json")
    return {name: shown_value(name, value) for name, value in values.items()}


def format_toml(resolved: ResolvedSettings) -> str:
    values = shown_settings(resolved)
    lines = [
        f"# {name} is unset" if value is None else f"{name} = {toml_value(value)}"
        for name, value in values.items()
    ]
    width = max(len(line) for line in lines)
    return "\n".join(
        f"{line:<{width}}  # {resolved.sources[name]}" for line, name in zip(lines, values, strict=True)
    )


def main(args: argparse.Namespace) -> int:
    resolved = resolve_settings(args)
    if args.json:
        print(json.dumps(shown_settings(resolved), indent=2))
    else:
        print(format_toml(resolved))
    return 0
