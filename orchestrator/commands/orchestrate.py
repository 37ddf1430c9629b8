"""`rlship orchestrate`: the orchestrator alone, as `rlship run` starts it (or an operator
beside workers and trainers started elsewhere). Ends in one line for each way a run
cannot go on; the run's keys are kept, so the same command resumes it."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import redis

from orchestrator.commands.checks import preflight_client
from orchestrator.diagnosis import RedisOutOfMemory
from orchestrator.errors import CannotShip, EmptySteps, LeaseLost, RankSilent, RunStateLost
from orchestrator.lease import ALIVE_SECONDS
from orchestrator.logs import configure_logging
from orchestrator.orchestrator import Orchestrator
from orchestrator.resume import ResumeRefused
from orchestrator.settings import RunSettings
from orchestrator.settings_resolution import add_settings_arguments, settings_from_args
from tasks.logs import mask_secrets
from transport.connection import OUTAGE_SECONDS, connect_redis_async
from transport.run_files import DiskFull, restrict

T = TypeVar("T")
CANCEL_AGAIN_SECONDS = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument("--summary-out", type=Path, default=None)


async def _orchestrate(settings: RunSettings) -> dict[str, Any]:
    client = connect_redis_async(settings.redis_url, socket_timeout=30)
    try:
        return await Orchestrator(settings, client).run()
    finally:
        await client.aclose()


async def interrupted_by_sigterm(work: Coroutine[Any, Any, T]) -> T:
    """SIGTERM stops `work` as Ctrl-C does (one line, the run's keys kept): it cancels the
    task from the event loop and the cancellation ends as KeyboardInterrupt. Raised from a
    Python signal handler instead, the interrupt could land in a finalizer, where Python drops
    it: one SIGTERM was lost that way and the run went on to its last step. The task is
    cancelled again every `CANCEL_AGAIN_SECONDS` until it ends: a coroutine it passes through
    can absorb a cancellation (`orchestrator.waits` says how one did), and a run told to stop
    must not go on."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    again: asyncio.TimerHandle | None = None  # set by a SIGTERM that found the work running

    def cancel_on_sigterm() -> None:
        nonlocal again
        if again is not None:
            again.cancel()  # one repeat at a time, however many SIGTERMs come
        if not task.done():
            task.cancel()
            again = loop.call_later(CANCEL_AGAIN_SECONDS, cancel_on_sigterm)

    loop.add_signal_handler(signal.SIGTERM, cancel_on_sigterm)
    try:
        return await work
    except asyncio.CancelledError:
        if again is not None:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        if again is not None:
            again.cancel()


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args).for_role("orchestrator")
    configure_logging(settings.log_json, logging.WARNING, run_id=settings.run_id)
    restrict(settings.file_mode)
    preflight_client("orchestrate", settings, unfinished_run=True).close()
    try:
        summary = asyncio.run(interrupted_by_sigterm(_orchestrate(settings)))
    except KeyboardInterrupt:
        print(
            f"rlship orchestrate: run {settings.run_id} interrupted; its tasks are dropped within "
            f"{ALIVE_SECONDS} s, its keys kept: the same command resumes it",
            file=sys.stderr,
        )
        return 130
    except (RunStateLost, RedisOutOfMemory, LeaseLost) as exc:
        print(f"rlship orchestrate: {exc}", file=sys.stderr)
        return 3
    except (CannotShip, DiskFull, ResumeRefused) as exc:
        print(f"rlship orchestrate: run {settings.run_id} stopped: {exc}", file=sys.stderr)
        return 2
    except EmptySteps as exc:
        print(f"rlship orchestrate: run {settings.run_id} stopped: {exc}", file=sys.stderr)
        return 4
    except RankSilent as exc:
        print(f"rlship orchestrate: run {settings.run_id} stopped: {exc}", file=sys.stderr)
        return 1
    except redis.exceptions.OutOfMemoryError as exc:
        print(
            f"rlship orchestrate: Redis at {mask_secrets(settings.redis_url)} is out of memory ({exc}): "
            "raise its maxmemory or free memory, then start again (the run resumes)",
            file=sys.stderr,
        )
        return 3
    except redis.ResponseError as exc:
        shown = mask_secrets(settings.redis_url)
        print(f"rlship orchestrate: Redis at {shown} refused a command: {exc}", file=sys.stderr)
        return 3
    except redis.ConnectionError as exc:
        print(
            f"rlship orchestrate: Redis at {mask_secrets(settings.redis_url)} stayed unreachable "
            f"for {OUTAGE_SECONDS:.0f} s: {exc}",
            file=sys.stderr,
        )
        return 3
    if args.summary_out is not None:
        args.summary_out.write_text(json.dumps(summary))
    return 0
