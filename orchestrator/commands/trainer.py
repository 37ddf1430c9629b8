"""`rlship trainer`: one reference trainer rank. It receives each step, checks it and
records what it received in Redis; restarted, it resumes after the last step it recorded."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from orchestrator.commands.checks import preflight_client, rank_in_run
from orchestrator.commands.findings import require
from orchestrator.logs import configure_logging
from orchestrator.settings_resolution import add_settings_arguments, settings_from_args
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.replay import RetainedPayloads
from transport.schema import WIRE_PROFILES
from transport.trainer import TrainerRank, open_receiver
from transport.zmq_curve import MissingKey, client_keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument("--rank", type=int, required=True, help="this rank, 0 to ranks - 1")
    parser.add_argument(
        "--idle-timeout", type=float, default=None, help="exit after this long without a step"
    )


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args).for_role("trainer")
    configure_logging(settings.log_json, logging.INFO, run_id=settings.run_id, rank=args.rank)
    require("trainer", [rank_in_run(args.rank, settings.ranks)])
    preflight_client("trainer", settings).close()
    try:
        curve = client_keys(Path(str(settings.zmq_keys_dir)), args.rank) if settings.zmq_curve else None
    except MissingKey as exc:
        raise SystemExit(f"rlship trainer: {exc}") from None
    client = connect_redis(settings.redis_url)
    received = client.hkeys(RunKeys(settings.run_id).received(args.rank))
    next_step = max((int(s) + 1 for s in received), default=settings.start_step)
    receiver = open_receiver(
        settings.transport,
        args.rank,
        run_id=settings.run_id,
        host=settings.zmq_host,
        port=settings.zmq_port,
        output_dir=Path(settings.output_dir),
        next_step=next_step,
        replay=RetainedPayloads(client, settings.run_id),
        curve=curve,
        file_mode=settings.file_mode,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        rank = TrainerRank(
            receiver,
            client,
            settings.run_id,
            settings.ranks,
            settings.first_step,
            WIRE_PROFILES[settings.wire],
        )
        rank.run(steps=settings.step_numbers.stop - next_step, idle_timeout=args.idle_timeout, stop=stop)
    finally:
        receiver.close()
    return 0
