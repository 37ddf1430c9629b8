"""`rlship keys`: a run's CURVE key pairs (`--zmq-curve`), the ship worker's and one per
rank, in its `zmq_keys_dir`, and where each file goes. Pairs already there are kept, so the
command is safe to repeat and never replaces a key a host has been given."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.settings_resolution import (
    RUN_DEFAULTS,
    add_settings_arguments,
    resolve_settings,
    run_defaults,
)
from transport.zmq_curve import SERVER, make_keys, public_file, rank_name, secret_file

# What the command reads: the run names the directory (output_dir/keys unless given) and its ranks.
SETTINGS = {"run_id", "output_dir", "zmq_keys_dir", "ranks"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, RUN_DEFAULTS, only=SETTINGS)


def placement(directory: Path, ranks: int) -> list[str]:
    """One line per file: which host it goes to."""
    publics = " ".join(str(public_file(directory, rank_name(rank))) for rank in range(ranks))
    lines = [
        f"  {secret_file(directory, SERVER)}: the ship worker's host only (its zmq_keys_dir)",
        f"  {publics}: the ship worker's host (the ranks it admits)",
        f"  {public_file(directory, SERVER)}: every rank's host",
    ]
    for rank in range(ranks):
        lines.append(f"  {secret_file(directory, rank_name(rank))}: rank {rank}'s host only")
    return lines


def main(args: argparse.Namespace) -> int:
    resolved = resolve_settings(args)
    if resolved.sources["run_id"] == "default":
        raise SystemExit("rlship keys: name the run: --run-id R (or run_id in --config)")
    settings = run_defaults(resolved)
    directory = Path(str(settings.zmq_keys_dir))
    made = make_keys(directory, settings.ranks)
    new = [name for name, fresh in made if fresh]
    kept = [name for name, fresh in made if not fresh]
    summary = f"made {', '.join(new) or 'none'}" + (f"; kept {', '.join(kept)}" if kept else "")
    print(f"rlship keys: run {settings.run_id}'s CURVE keys in {directory} ({summary}); secret keys 0600:")
    print("\n".join(placement(directory, settings.ranks)))
    return 0
