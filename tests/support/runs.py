"""Helpers for tests of whole `rlship run` processes: the command of a small run, the
processes and queue traces a run leaves, and its keys without an expiry."""

from __future__ import annotations

import contextlib

import psutil
import redis

from orchestrator.commands.processes import delete_queues
from tests.support.processes import python_command, session_queue, wait_for
from transport.keys import RunKeys, run_queue, ship_port_claim
from transport.port_claims import port_claims

# One atomic look at the run's keys (a SCAN would let a key be written between two TTLs).
_UNEXPIRING_LUA = """
local found = {}
for _, key in ipairs(redis.call('KEYS', ARGV[1])) do
  if redis.call('TTL', key) == -1 then table.insert(found, key) end
end
return found
"""


def run_arguments(run_id: str, steps: int, output_dir, port: int, own_queues: bool = False) -> list[str]:
    """A small `rlship run`'s arguments, on the session's queues, or with `own_queues` on the
    run's own."""
    queues = [] if own_queues else [
        "--cpu-queue", session_queue(f"cpu-{run_id}"), "--ship-queue", session_queue(f"ship-{run_id}"),
    ]  # fmt: skip
    return [
        "run", "--steps", str(steps), "--run-id", run_id,
        "--batch-size", "16", "--group-size", "4", "--seq-len", "512", "--zmq-port", str(port),
        "--output-dir", str(output_dir), *queues,
    ]  # fmt: skip


def run_command(run_id: str, steps: int, output_dir, port: int, own_queues: bool = False) -> list[str]:
    """A small `rlship run` (`run_arguments`) as a command line."""
    return python_command(*run_arguments(run_id, steps, output_dir, port, own_queues))


def _running_for(run_id: str) -> dict[psutil.Process, str]:
    """Processes naming the run in their command line or environment (the run's children),
    with their command lines."""
    found = {}
    for process in psutil.process_iter(["cmdline", "environ"]):
        command = " ".join(process.info["cmdline"] or [])
        if run_id in command or (process.info["environ"] or {}).get("RLSHIP_RUN_ID") == run_id:
            found[process] = command
    return found


def processes_of(run_id: str) -> list[str]:
    """The command lines of the processes naming the run (the run's children)."""
    return list(_running_for(run_id).values())


def wait_for_every_process_to_stop(run_id: str, seconds: float) -> None:
    """Wait until no process names the run; any still running after `seconds` is SIGKILLed
    by PID (the test started it: none outlives the test) and the test fails."""
    try:
        wait_for("every process of the run to stop", lambda: not _running_for(run_id), seconds)
    finally:
        for process in _running_for(run_id):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def keys_without_expiry(client: redis.Redis, run_id: str) -> list[str]:
    return sorted(key.decode() for key in client.eval(_UNEXPIRING_LUA, 0, RunKeys(run_id).prefix + "*"))


def own_queue_traces(client: redis.Redis, run_id: str) -> dict[str, str]:
    """What is left of the run's own queues, each trace with how it goes: `expires` (a key
    with an expiry) or `forever`."""
    traces = {}
    for key in RunKeys(run_id).own_queue_traces:
        ttl = client.ttl(key)
        if ttl != -2:
            traces[key] = "expires" if ttl > 0 else "forever"
    return traces


def forget_run(client: redis.Redis, run_id: str) -> None:
    """The run's keys, its port claims (a killed run's would hold its pair for a minute, and
    a later test's random pair may be it) and the traces of its queues (the session's, or
    its own)."""
    claims = [ship_port_claim(c.host, c.port) for c in port_claims(client) if c.run_id == run_id]
    keys = client.keys(f"{RunKeys(run_id).prefix}*") + claims
    if keys:
        client.delete(*keys)
    own = [run_queue(run_id, kind) for kind in ("cpu", "ship")]
    delete_queues(client, [f"cpu-{run_id}", f"ship-{run_id}", *own])
