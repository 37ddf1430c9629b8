"""compose.yaml and the Procfile as Compose and honcho read them, for tests of both."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from tests.support.processes import REPO

# Compose's interpolation (compose-spec "Interpolation"): `$$` is a literal `$`; `${VAR}` and
# `$VAR`; `${VAR:-default}` / `${VAR-default}` (unset or empty / unset); `${VAR:?error}` /
# `${VAR?error}` fail loading the file; `${VAR:+alternative}` / `${VAR+alternative}`.
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<plain>[A-Za-z_]\w*)|\{(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\})"
)


class InterpolationError(ValueError):
    """What `docker compose` (any subcommand) stops on when it loads the file."""


def compose_interpolate(value: Any, env: dict[str, str]) -> Any:
    """Every string in the loaded file interpolated as Compose does it against `env`."""
    if isinstance(value, dict):
        return {key: compose_interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [compose_interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["plain"] or match["name"]
        op, arg, current = match["op"] or "", match["arg"] or "", env.get(name)
        missing = current is None or (op.startswith(":") and current == "")
        if op.endswith("-"):
            return arg if missing else current or ""
        if op.endswith("?"):
            if missing:
                raise InterpolationError(f"required variable {name} is missing a value: {arg}")
            return current or ""
        if op.endswith("+"):
            return "" if missing else arg
        return current or ""

    return _VARIABLE.sub(replace, value)


def compose(env: dict[str, str] | None = None, profiles: tuple[str, ...] = ()) -> dict[str, Any]:
    """compose.yaml as Compose sees it with `env` (default: no variable set) and the profiles
    `--profile` names: a service with `profiles` is there only when one of them is active
    (given, or in COMPOSE_PROFILES, comma-separated), a service without is always there."""
    env = env or {}
    loaded = compose_interpolate(yaml.safe_load((REPO / "compose.yaml").read_text()), env)
    active = set(profiles) | {name for name in env.get("COMPOSE_PROFILES", "").split(",") if name}
    loaded["services"] = {
        name: service
        for name, service in loaded["services"].items()
        if not service.get("profiles") or active & set(service["profiles"])
    }
    return loaded


def env_file(path: Path, shell: dict[str, str] | None = None) -> dict[str, str]:
    """The variables `docker compose --env-file PATH` interpolates with: the file's `KEY=VALUE`
    lines (`#` comments and blank lines skipped), the shell's own winning."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return {**values, **(shell or {})}


def container_argv(command: list[str]) -> list[str]:
    """The program a service's container ends up running: its command, or what a
    `sh -c` script `exec`s after its checks."""
    if command[:2] == ["sh", "-c"]:
        return shlex.split(command[2].rsplit("exec ", 1)[1])
    return command


def procfile() -> dict[str, list[str]]:
    """Process name -> argv, with `${VAR:-default}` at its default and the `&& ...` tail cut."""
    processes = {}
    for line in (REPO / "Procfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, command = line.split(":", 1)
            command = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", command.split("&&")[0])
            processes[name.strip()] = shlex.split(command)
    return processes
