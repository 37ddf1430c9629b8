"""`rlship status [RUN_ID]`: a run seen from another terminal, with the display `rlship run`
draws (orchestrator.commands.progress): one frame, or with `--follow` live, as `docker logs
-f` and `kubectl logs -f` follow; without a run id, the runs Redis holds and their state.
RUN_ID may be the run's output directory (a path: its `run.json` names the run).

A run is `running` while an orchestrator holds its lease (renewed every second, gone
within `LEASE_SECONDS` of its death), `finished` once it shipped every step, `stopped`
otherwise (interrupted, failed or killed: the same run id resumes it). Everything is read
from Redis; the run's keys expire a day after it ends, and so it leaves the list."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from orchestrator.commands.findings import require
from orchestrator.commands.named_run import run_of_directory
from orchestrator.commands.progress import REFRESH_SECONDS, ProgressDisplay
from orchestrator.commands.redis_checks import probe_redis
from orchestrator.redis_topology import read_topology
from orchestrator.run_info import RunInfo
from orchestrator.settings_resolution import add_settings_arguments, settings_from_args
from orchestrator.status_reader import StatusReader
from tasks.logs import mask_secrets
from transport.connection import RedisAddress, connect_redis
from transport.keys import RunKeys, run_id_of_marker, run_markers_pattern
from transport.rank_contact import RankContact

RUNNING, FINISHED, STOPPED = "running", "finished", "stopped"


@dataclass(frozen=True)
class RunRow:
    """One run as the list shows it."""

    run_id: str
    state: str
    shipped: int
    steps: int | None  # None: no orchestrator of the run wrote its info
    started_at: float
    updated_at: float | None  # the orchestrator's last status write

    def line(self, now: float) -> str:
        wanted = "?" if self.steps is None else str(self.steps)
        updated = "never" if self.updated_at is None else f"{max(0.0, now - self.updated_at):.1f} s ago"
        return (
            f"{self.run_id:<32} {self.state:<9} {f'{self.shipped}/{wanted}':>9}  "
            f"{updated:>14}  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started_at))}"
        )


HEADER = f"{'RUN_ID':<32} {'STATE':<9} {'SHIPPED':>9}  {'STATUS UPDATED':>14}  STARTED"


def run_row(client: redis.Redis, run_id: str) -> RunRow | None:
    """The run's state, or None if Redis holds no run of that id."""
    state = RunKeys(run_id)
    pipe = client.pipeline(transaction=False)
    pipe.get(state.run_marker)
    pipe.exists(state.finished)
    pipe.exists(state.orchestrator_lease)
    pipe.hlen(state.published)
    pipe.hget(state.status, "updated_at")
    started, finished, leased, shipped, updated = pipe.execute()
    if started is None:
        return None
    info = RunInfo.read(client, run_id)
    return RunRow(
        run_id,
        FINISHED if finished else RUNNING if leased else STOPPED,
        int(shipped),
        None if info is None else info.steps,
        float(started),
        None if updated is None else float(updated),
    )


def list_runs(client: redis.Redis) -> list[RunRow]:
    """Every run Redis holds (its start mark), oldest first."""
    markers = client.scan_iter(match=run_markers_pattern(), count=1000)
    run_ids = {run_id_of_marker(key.decode()) for key in markers}
    rows = [row for run_id in run_ids if (row := run_row(client, run_id)) is not None]
    return sorted(rows, key=lambda row: row.started_at)


def show(client: redis.Redis, row: RunRow, info: RunInfo, follow: bool) -> None:
    """The run's status, one frame; with `follow`, live (records as they are published)
    until it is no longer running or Ctrl-C."""
    reader = StatusReader(client, info.run_id, info.queues, info.ranks)
    # The run's time so far; an ended run's, up to its orchestrator's last status.
    until = time.time() if row.state == RUNNING or row.updated_at is None else row.updated_at
    display = ProgressDisplay(reader, sys.stdout, info.steps, info.ranks, until - row.started_at)
    run_seconds = client.hget(RunKeys(info.run_id).status, "run_seconds")
    ended = None if row.state == RUNNING or run_seconds is None else float(run_seconds)
    display.update(
        status=True, elapsed=ended
    )  # where the run stands, at once; an ended run's time as its summary said
    followed = False
    while follow and (current := run_row(client, info.run_id)) is not None and current.state == RUNNING:
        time.sleep(REFRESH_SECONDS)
        display.update()
        followed = True
    if followed:  # the frame it ended on (a run already over was shown once, above)
        display.update(status=True)
    # Where each trainer rank was last seen: the first thing to ask of a run that waits.
    now = time.time()
    for contact in RankContact.read(client.hgetall(RunKeys(info.run_id).rank_contact), info.ranks):
        print(f"rank {contact.rank}: {contact.describe(now)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", default=None, metavar="RUN_ID",
                        help="the run to show, or its output directory; without it, the runs")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="list the runs Redis holds (the default)")
    follow = "follow the run, live, until it is no longer running (Ctrl-C leaves it)"
    parser.add_argument("-f", "--follow", action="store_true", help=follow)
    parser.add_argument("--json", action="store_true", help="the list as JSON")
    add_settings_arguments(parser, only={"redis_url"})  # all it reads: the runs are in Redis


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    require("status", [probe_redis(settings.redis_url).check])  # one line, as every command says it
    client = connect_redis(
        settings.redis_url, ride_out_outages=False, socket_timeout=5, socket_connect_timeout=5
    )
    where = f"Redis at {mask_secrets(settings.redis_url)}"
    if args.run is None or args.list:
        rows = list_runs(client)
        if args.json:
            print(json.dumps([asdict(row) for row in rows]))
        elif not rows:
            print(f"no runs in {where}")
        else:
            now = time.time()
            print("\n".join([HEADER, *(row.line(now) for row in rows)]))
        return 0
    run_id = run_of_directory("status", Path(args.run)).run_id if os.sep in args.run else args.run
    row = run_row(client, run_id)
    info = RunInfo.read(client, run_id)
    if row is None or info is None:
        missing = "no run" if row is None else "no orchestrator's description of run"
        print(
            f"rlship status: {where} holds {missing} {run_id!r} (`rlship status` lists the runs)",
            file=sys.stderr,
        )
        return 2
    if RedisAddress.parse(settings.redis_url).is_sentinel:
        topology = read_topology(settings.redis_url, client)
        print(f"redis: {topology.line(settings.redis_wait_replicas or 0, settings.redis_wait_timeout_ms)}")
    print(HEADER)
    print(row.line(time.time()))
    try:
        show(client, row, info, args.follow)
    except KeyboardInterrupt:
        return 130
    return 0
