"""Settings as a command resolves them: the environment, then a TOML file (`--config PATH`
or `RLSHIP_CONFIG`), then command-line flags, each later source winning. An invalid value
stops start-up with a message naming the setting, its value (secrets masked) and where it
came from."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import ValidationError

from orchestrator.settings import CONFIG_ENV, RunSettings, env_name, shown_value, unknown_variables
from tasks.logs import mask_secrets


def fresh_run_id() -> str:
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


# What `rlship run` uses for a setting left unset, where that is not the model's default
# (`run_defaults`): shown by `rlship run --help`, `rlship config show` and docs/settings.md.
RUN_DEFAULTS = {
    "run_id": "a fresh id per run: run-YYYYMMDD-HHMMSS-XXXX",
    "output_dir": "runs/RUN_ID",
}


def choices(annotation: Any) -> tuple[str, ...] | None:
    """The values a `Literal` setting (optional or not) takes, for the flag's choices."""
    literals = [arg for arg in (annotation, *get_args(annotation)) if get_origin(arg) is Literal]
    return tuple(value for literal in literals for value in get_args(literal)) or None


def default_text(name: str, defaults: Mapping[str, str]) -> str:
    """A setting's default as a command uses it: `defaults` (such as `RUN_DEFAULTS`) first."""
    if name in defaults:
        return defaults[name]
    default = RunSettings.model_fields[name].default
    return "unset" if default is None else str(shown_value(name, default))


def add_settings_arguments(
    parser: argparse.ArgumentParser,
    defaults: Mapping[str, str] | None = None,
    only: Collection[str] | None = None,
) -> None:
    """`--config` and one `--flag` per setting (`only` those a command reads; default: unset,
    so the file's or the environment's value stands); its help shows the description, the
    variable and the default the command uses (`defaults` where it differs from the model's)."""
    parser.add_argument("--config", type=Path, default=None, help=f"TOML file of settings (env {CONFIG_ENV})")
    for name, field in RunSettings.model_fields.items():
        if only is not None and name not in only:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description}; env {env_name(name)}; default {default_text(name, defaults or {})}"
        help_text = help_text.replace("%", "%%")
        if field.annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                flag, dest=name, default=None, choices=choices(field.annotation), help=help_text
            )


def read_config_file(path: Path) -> dict[str, Any]:
    """A TOML file of settings by name (`batch_size` or `batch-size`). An unknown key stops
    start-up: a misspelt setting would otherwise be ignored without a word."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SystemExit(f"rlship: config file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise SystemExit(f"rlship: config file {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SystemExit(f"rlship: config file {path}: invalid TOML: {exc}") from exc
    values = {key.replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(set(values) - set(RunSettings.model_fields))
    if unknown:
        raise SystemExit(
            f"rlship: config file {path}: unknown setting(s) {', '.join(unknown)} "
            "(`rlship config show` lists them)"
        )
    return values


@dataclass(frozen=True)
class ResolvedSettings:
    """The settings and, per setting, where its value came from."""

    settings: RunSettings
    sources: dict[str, str]


def resolve_settings(args: argparse.Namespace) -> ResolvedSettings:
    """Environment, then the TOML file, then flags; exits with a message naming the bad setting."""
    for line in unknown_variables(os.environ):
        print(f"rlship: warning: {line}", file=sys.stderr)
    flags = {n: v for n in RunSettings.model_fields if (v := getattr(args, n, None)) is not None}
    config = getattr(args, "config", None) or os.environ.get(CONFIG_ENV) or None
    from_file = read_config_file(Path(config)) if config else {}
    environment = {key.upper() for key in os.environ}
    sources = {}
    for name in RunSettings.model_fields:
        if name in flags:
            sources[name] = "--" + name.replace("_", "-")
        elif name in from_file:
            sources[name] = str(config)
        elif env_name(name) in environment:
            sources[name] = env_name(name)
        else:
            sources[name] = "default"
    try:
        settings = RunSettings(**{**from_file, **flags})
    except ValidationError as exc:
        raise SystemExit(f"rlship: invalid setting: {validation_problems(exc, sources)}") from exc
    return ResolvedSettings(settings, sources)


def validation_problems(exc: ValidationError, sources: Mapping[str, str]) -> str:
    """Each problem on one line's worth: the setting, its value (secrets masked), its source."""
    problems = []
    for error in exc.errors():
        if not error["loc"]:  # a check across settings: its message starts with the name
            message = error["msg"].removeprefix("Value error, ")
            problems.append(f"{message} (from {sources.get(message.split(':', 1)[0], 'input')})")
            continue
        name = str(error["loc"][0])
        name = name if name in sources else name.lower()
        value = shown_value(name, error.get("input"))
        problems.append(f"{name}={value!r} (from {sources.get(name, 'input')}): {error['msg']}")
    return mask_secrets("; ".join(problems))


def run_defaults(resolved: ResolvedSettings) -> RunSettings:
    """The settings `rlship run` uses: `RUN_DEFAULTS` for the ones left unset."""
    settings = resolved.settings
    if resolved.sources["run_id"] == "default":
        settings = settings.with_changes(run_id=fresh_run_id())
    if resolved.sources["output_dir"] == "default":
        settings = settings.with_changes(output_dir=Path("runs") / settings.run_id)
    return settings


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    """Environment, then the TOML file, then flags; exits with a message naming the bad setting."""
    return resolve_settings(args).settings
