"""`rlship config show`: the effective settings, and where each value came from;
`rlship config table`: every setting as docs/settings.md's table.

`config show` takes the same `--config` file and flags as every other command, so an
operator sees what `rlship run` would run with before starting it; for a run Redis holds
(`--run-id R`, or its output directory), the run's stored settings with the ones given
applied as a resume would apply them (orchestrator.resume). The default output is TOML
(secrets masked, each setting's description above it, its source beside it) that
`--config` reads back; `--json` prints the values alone as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from orchestrator.commands.named_run import NamedRun, add_run_dir_argument, named_run
from orchestrator.resume import ResumeRefused
from orchestrator.settings import RunSettings, env_name, shown_value
from orchestrator.settings_resolution import (
    RUN_DEFAULTS,
    ResolvedSettings,
    add_settings_arguments,
    choices,
    default_text,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_dir_argument(parser)
    add_settings_arguments(parser, RUN_DEFAULTS)
    parser.add_argument("--json", action="store_true", help="print the values as one JSON object")


def toml_value(value: Any) -> str:
    """A TOML literal: JSON's string escapes are TOML's, and so are its numbers."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value) if isinstance(value, Path) else value)


def decided_at_start(resolved: ResolvedSettings) -> set[str]:
    """The settings `rlship run` decides as it starts (`RUN_DEFAULTS` left unset), and then
    the derived ones, which may follow them."""
    undecided = {name for name in RUN_DEFAULTS if resolved.sources[name] == "default"}
    return undecided | resolved.settings.derived() if undecided else set()


def shown_settings(resolved: ResolvedSettings) -> dict[str, Any]:
    """The values `rlship run` would use, masked; None where it decides them at start."""
    values = resolved.settings.model_dump(mode="json")
    unknown = decided_at_start(resolved)
    return {name: None if name in unknown else shown_value(name, value) for name, value in values.items()}


def format_toml(resolved: ResolvedSettings) -> str:
    """TOML `--config` reads back: a setting left unset, or derived from the others, is a
    comment (derived, with its value when known), so the file leaves it to derive again."""
    values = shown_settings(resolved)
    derived = resolved.settings.derived()

    def line(name: str, value: Any) -> str:
        if name in derived:
            return f"# {name} is unset (derived" + ("" if value is None else f": {toml_value(value)}") + ")"
        if value is None:
            return f"# {name} is unset" + (f" ({RUN_DEFAULTS[name]})" if name in RUN_DEFAULTS else "")
        return f"{name} = {toml_value(value)}"

    lines = [line(name, value) for name, value in values.items()]
    width = max(len(text) for text in lines)
    sources = {name: "derived" if name in derived else source for name, source in resolved.sources.items()}
    return "\n".join(
        f"# {RunSettings.model_fields[name].description}\n{text:<{width}}  # {sources[name]}"
        for text, name in zip(lines, values, strict=True)
    )


def heading(run: NamedRun) -> str | None:
    """Whose settings these are, when Redis holds the run (or could not be asked)."""
    if run.unread is not None:
        return f"# {run.unread}: the run's stored settings, if any, are not shown"
    if run.stored is None:
        return None
    run_id = run.given.settings.run_id
    if run.stored.finished:
        return f"# run {run_id}'s stored settings ({run.stored.state()}): its id is not used again"
    resumes = f"`rlship run --run-id {run_id}` resumes it with these"
    return f"# run {run_id}'s stored settings ({run.stored.state()}): {resumes}"


def main(args: argparse.Namespace) -> int:
    run = named_run("config show", args)
    try:
        resolved = run.taken_up()
    except ResumeRefused as exc:
        raise SystemExit(f"rlship config show: {exc}") from None
    if args.json:
        print(json.dumps(shown_settings(resolved), indent=2))
        return 0
    print("\n".join(filter(None, [heading(run), format_toml(resolved)])))
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
