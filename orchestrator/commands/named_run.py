"""The run a command names, by `--run-id` or by its output directory (`rlship doctor
runs/R`: the `run.json` its orchestrator wrote there names it), looked at as Redis holds
it: its stored settings with the ones given applied as a resume would apply them
(orchestrator.resume, the one place that decides it), and where it stands. Shared by
`config show`, `doctor` and `status`, so each shows the run as `rlship run --run-id R`
would take it up."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import redis

from orchestrator.resume import StoredRun, given_again, resumed
from orchestrator.run_info import RUN_INFO_FILE, RunInfo
from orchestrator.settings_resolution import ResolvedSettings, resolve_settings
from tasks.logs import mask_secrets
from transport.connection import connect_redis


def add_run_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", type=Path, default=None, metavar="RUN_DIR",
                        help="a run's output directory (runs/RUN_ID): its run id and output dir")  # fmt: skip


def run_of_directory(command: str, directory: Path) -> RunInfo:
    """The run whose output directory `directory` is; refused in one line if it is none."""
    info = RunInfo.of_directory(directory)
    if info is None:
        raise SystemExit(
            f"rlship {command}: {directory} is not a run's output directory (no {RUN_INFO_FILE} in it, "
            "which a run's orchestrator writes as it starts): name the run by its id"
        )
    return info


def resolve_named(command: str, args: argparse.Namespace) -> ResolvedSettings:
    """The command's settings (orchestrator.settings_resolution), the run id that of the
    positional RUN_DIR when one is given (its `run.json` the source)."""
    if args.run_dir is None:
        return resolve_settings(args)
    info = run_of_directory(command, args.run_dir)
    if args.run_id not in (None, info.run_id):
        raise SystemExit(
            f"rlship {command}: {args.run_dir} holds run {info.run_id}, not --run-id {args.run_id}"
        )
    args.run_id = info.run_id
    resolved = resolve_settings(args)
    return ResolvedSettings(
        resolved.settings, {**resolved.sources, "run_id": str(args.run_dir / RUN_INFO_FILE)}
    )


@dataclass(frozen=True)
class NamedRun:
    """The settings as a command was given them, the run directory it named, and the run as
    Redis holds it (None: Redis holds no run of that id, none was named, or Redis did not
    answer: `unread` then says why)."""

    given: ResolvedSettings
    run_dir: Path | None
    stored: StoredRun | None
    unread: str | None = None

    def taken_up(self) -> ResolvedSettings:
        """The settings `rlship run --run-id` would take the run up with: its stored ones with
        the given ones applied as a resume applies them (raises ResumeRefused where a resume
        would be refused), each setting's source the one given where it changes the run's,
        `derived` where derived, else the run's stored settings. A run Redis does not hold:
        the settings given, its output directory the RUN_DIR named, unless one was given."""
        given = self.given
        if self.stored is None:
            if self.run_dir is None or given.sources["output_dir"] != "default":
                return given
            settings = given.settings.with_changes(output_dir=self.run_dir)
            return ResolvedSettings(settings, {**given.sources, "output_dir": str(self.run_dir)})
        settings, changes = resumed(self.stored.settings, given.settings, given_again(given.sources))
        derived = settings.derived()

        def source(name: str, was: str) -> str:
            if name in changes:
                return f"{was}: {changes[name]}"
            if name in ("run_id", "redis_url"):  # how the run is named and reached, never stored
                return was
            return "derived" if name in derived else f"run {settings.run_id}'s stored settings"

        return ResolvedSettings(settings, {name: source(name, was) for name, was in given.sources.items()})


def named_run(command: str, args: argparse.Namespace) -> NamedRun:
    """The settings given to `command` and what Redis holds of the run they name (by
    `--run-id` or RUN_DIR); a Redis that does not answer holds nothing here, and says so."""
    given = resolve_named(command, args)
    if given.sources["run_id"] == "default":
        return NamedRun(given, args.run_dir, None)
    settings = given.settings
    try:
        client = connect_redis(
            settings.redis_url, ride_out_outages=False, socket_connect_timeout=2, socket_timeout=5
        )
        try:
            stored = StoredRun.read(client, settings.run_id)
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:
        unread = mask_secrets(f"Redis at {settings.redis_url} did not answer ({exc})")
        return NamedRun(given, args.run_dir, None, unread)
    return NamedRun(given, args.run_dir, stored)
