"""`rlship config show`: the effective settings, and where each value came from;
`rlship config table`: every setting as docs/settings.md's table.

`config show` takes the same `--config` file and flags as every other command, so an
operator sees what `rlship run` would run with before starting it. The default output is
TOML (secrets masked, each setting's description above it) that `--config` reads back;
`--json` prints the values alone as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from orchestrator.settings import RunSettings, env_name, shown_value
from orchestrator.settings_resolution import (
    RUN_DEFAULTS,
    ResolvedSettings,
    add_settings_arguments,
    choices,
    default_text,
    resolve_settings,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, RUN_DEFAULTS)
    parser.add_argument("--json", action="store_true", help="print the values as one JSON object")


def toml_value(value: Any) -> str:
    """A TOML literal: JSON's string escapes are TOML's, and so are its numbers."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value) if isinstance(value, Path) else value)


def shown_settings(resolved: ResolvedSettings) -> dict[str, Any]:
    """The values `rlship run` would use, masked; None where it decides at start (`RUN_DEFAULTS`,
    and the settings derived from others, which its description says how)."""
    values = resolved.settings.model_dump(mode="json")
    decided_at_start = {name for name in RUN_DEFAULTS if resolved.sources[name] == "default"}
    decided_at_start |= resolved.settings.derived()
    return {
        name: None if name in decided_at_start else shown_value(name, value) for name, value in values.items()
    }


def format_toml(resolved: ResolvedSettings) -> str:
    values = shown_settings(resolved)
    lines = [
        f"{name} = {toml_value(value)}"
        if value is not None
        else f"# {name} is unset" + (f" ({RUN_DEFAULTS[name]})" if name in RUN_DEFAULTS else "")
        for name, value in values.items()
    ]
    width = max(len(line) for line in lines)
    return "\n".join(
        f"# {RunSettings.model_fields[name].description}\n{line:<{width}}  # {resolved.sources[name]}"
        for line, name in zip(lines, values, strict=True)
    )


def main(args: argparse.Namespace) -> int:
    resolved = resolve_settings(args)
    if args.json:
        print(json.dumps(shown_settings(resolved), indent=2))
    else:
        print(format_toml(resolved))
    return 0


def settings_table() -> str:
    """Every setting as a Markdown table, from the model: docs/settings.md holds this (a test compares)."""
    rows = ["| setting | flag, variable | default | what it is |", "|---|---|---|---|"]
    for name, field in RunSettings.model_fields.items():
        default = default_text(name, {}) if field.default is None else f"`{default_text(name, {})}`"
        if name in RUN_DEFAULTS:
            default = f"`rlship run`: {RUN_DEFAULTS[name]}; other commands: {default}"
        values = choices(field.annotation)
        described = f"{field.description} (one of {', '.join(values)})" if values else field.description
        flag = "--" + name.replace("_", "-")
        rows.append(f"| `{name}` | `{flag}`, `{env_name(name)}` | {default} | {described} |")
    return "\n".join(rows)


def add_table_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the table is the model's."""


def table_main(args: argparse.Namespace) -> int:
    print(settings_table())
    return 0
