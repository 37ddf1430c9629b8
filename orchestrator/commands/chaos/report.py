"""The report of `rlship chaos`: what the chaos run's trainer ranks received, compared
with the fault-free run's, against the goal."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from orchestrator.commands.chaos.kills import Kill

MIN_KILLS = 10  # a chaos run's goal: at least this many kills took effect


def compare(
    args: argparse.Namespace, step_numbers: range, expected: dict[str, Any], observed: dict[str, Any]
) -> dict[str, Any]:
    steps = [str(s) for s in step_numbers]
    delivered, duplicates, out_of_order, mismatches, in_window = {}, 0, 0, 0, 0
    # A send redone after a ship worker died between the message leaving and its mark (the
    # window docs/reliability.md states): the one way a stock rank gets a step twice.
    redone: dict[str, int] = observed.get("interrupted_sends", {})
    for rank, got in observed["ranks"].items():
        delivered[rank] = sum(s in got["checksums"] for s in steps)
        duplicates += sum(n - 1 for n in got["deliveries"].values())
        in_window += sum(n - 1 for s, n in got["deliveries"].items() if redone.get(f"{s}:{rank}", 0) >= n - 1)
        out_of_order += sum(b <= a for a, b in zip(got["order"], got["order"][1:], strict=False))
        mismatches += _mismatches(rank, got, expected, observed)
    kills: list[Kill] = observed["kills"]
    effective = [k for k in kills if k.fired]
    report = {
        "steps_expected": args.steps,
        "steps_delivered_per_rank": delivered,
        "duplicates_delivered": duplicates,
        "duplicates_in_window": in_window,
        "out_of_order": out_of_order,
        "payload_mismatches": mismatches,
        "records_published": len(set(observed["records"])),
        "records_duplicated": len(observed["records"]) - len(set(observed["records"])),
        "keys_left": len(observed["keys_left"]),
        "files_left": len(observed["files_left"]),
        "kills": len(effective),
        "kills_by_target": dict(Counter(k.target for k in effective)),
        "kills_by_stage": dict(Counter(k.stage for k in effective if k.stage)),
        "kill_log": [asdict(k) for k in kills],
        "reference_keys_left": len(expected["keys_left"]),
        "wall_seconds": {"fault_free": expected["wall_seconds"], "chaos": observed["wall_seconds"]},
        "rollouts_written": observed["rollouts_written"],
        "receivers": args.receivers,
        "hung_ranks": observed["hung_ranks"],
        "interrupted_sends": observed.get("interrupted_sends", {}),
        "command": (
            f"rlship chaos --steps {args.steps} --kill-every {args.kill_every:g} "
            f"--receivers {args.receivers} --ship-kills {args.ship_kills} "
            f"--kill-redis-primary {args.kill_redis_primary} --workload {args.workload} "
            f"--payload-store {args.payload_store} --json {args.json}"
        ),
    }
    report["goal_missed_by"] = _goal_missed_by(args, report, duplicates, out_of_order, mismatches)
    report["goal_met"] = not report["goal_missed_by"]
    return report


def _goal_missed_by(
    args: argparse.Namespace, report: dict[str, Any], duplicates: int, out_of_order: int, mismatches: int
) -> list[str]:
    """Each part of the goal the run missed, in words an operator reads in the summary."""
    delivered: dict[str, int] = report["steps_delivered_per_rank"]
    by_target: dict[str, int] = report["kills_by_target"]
    wanted = {
        "orchestrator": 1,
        "ship-worker": max(1, args.ship_kills),
        "redis-primary": args.kill_redis_primary,
    }
    checks = [
        (all(n == args.steps for n in delivered.values()), f"steps delivered per rank {delivered}"),
        (not report["hung_ranks"], f"hung ranks {report['hung_ranks']}"),
        (duplicates == 0, f"{duplicates} duplicates"),
        (out_of_order == 0, f"{out_of_order} out of order"),
        (mismatches == 0, f"{mismatches} payload mismatches"),
        (report["records_published"] == args.steps, f"{report['records_published']} records"),
        (report["records_duplicated"] == 0, f"{report['records_duplicated']} records duplicated"),
        (report["keys_left"] == 0, f"{report['keys_left']} keys left"),
        (report["files_left"] == 0, f"{report['files_left']} files left"),
        (
            report["kills"] >= MIN_KILLS,
            f"{report['kills']} kills, fewer than {MIN_KILLS} (more steps or a shorter --kill-every)",
        ),
    ]
    checks += [
        (by_target.get(target, 0) >= n, f"{by_target.get(target, 0)} {target} kills of {n}")
        for target, n in wanted.items()
        if n
    ]
    return [reason for met, reason in checks if not met]


def _mismatches(rank: str, got: dict[str, Any], expected: dict[str, Any], observed: dict[str, Any]) -> int:
    """Steps a rank received other than the fault-free run's. Side arrays by handle name
    each run's own files, so such payloads differ between the runs in their paths: there, a
    step is what its own run sent, and its rows (read through the handles) the fault-free
    run's."""
    want = expected["ranks"][rank]
    if not want["rows"]:
        return sum(got["checksums"][s] != want["checksums"].get(s) for s in got["checksums"])
    sent = observed["sent"]
    return sum(
        got["checksums"][s] != sent.get(f"{s}:{rank}") or got["rows"].get(s) != want["rows"].get(s)
        for s in got["checksums"]
    )


def print_report(report: dict[str, Any], path: Path) -> None:
    print(
        f"\nrlship chaos: {report['kills']} kills {report['kills_by_target']} "
        f"(stages {report['kills_by_stage']})\n"
        f"  steps delivered per rank {report['steps_delivered_per_rank']} of {report['steps_expected']}; "
        f"duplicates {report['duplicates_delivered']} ({report['duplicates_in_window']} of them sends "
        f"redone in the window between leaving and the mark), out of order {report['out_of_order']}, "
        f"payload mismatches {report['payload_mismatches']}; receivers {report['receivers']}, "
        f"hung ranks {report['hung_ranks']}, sends redone after an interrupted one "
        f"{sum(report['interrupted_sends'].values())}\n"
        f"  records {report['records_published']} (duplicated {report['records_duplicated']}), "
        f"keys left {report['keys_left']}, files left {report['files_left']}; "
        f"wall {report['wall_seconds']['fault_free']:.1f} s fault-free, "
        f"{report['wall_seconds']['chaos']:.1f} s chaos\n"
        f"  goal {'MET' if report['goal_met'] else 'MISSED: ' + '; '.join(report['goal_missed_by'])}; "
        f"details in {path}"
    )
