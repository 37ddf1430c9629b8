"""Writes that survive a failover: acknowledged by replicas (`WAIT`) before anything acts on them.

Redis replicates asynchronously: a primary that dies may take its last writes with it, and
the replica the Sentinels promote never saw them. For most of rlship's writes that is safe
(a stage's output and its done mark go together, and the stage runs again), but not for a
write that something outside Redis acts on: a rollout acknowledged to its producer, a cut
(the orchestrator enqueues its tasks), a `sending`/`last_sent` mark (a rank holds the step),
a published record (sinks have it). Each of those goes through `replicate`:

1. the write itself (idempotent, or guarded so that writing it again changes nothing);
2. then, in one pipeline on one connection, a probe write, the write's *witness* (a read that
   says it is there) and `WAIT replicas timeout`.

WAIT counts the replicas that have the stream up to that connection's last write, the
probe, which comes after the write on whichever primary holds it: so a true witness and
enough replicas mean the write is safe. A witness that is false means the write was lost in
a failover between the two: it is written again. A lost connection re-runs the pipeline
on the new primary (the clients' retries). Too few replicas (none has rejoined the new
primary yet): logged, and waited again; the run holds rather than act on a write it could
lose. Redis's replication stream is ordered, so every write made before one that is safe
is safe too.

Reads are confirmed the same way (`held`): the orchestrator takes a rollout record only once
replicas hold it, since its producer, still waiting on its own confirmation, writes a lost
one again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("rlship.replication")

PROBE_TTL_SECONDS = 3600
SHORT_LOG_SECONDS = 5.0  # how often a wait for too few replicas is logged


@dataclass(frozen=True)
class Durability:
    """How many replicas must hold a write before it is acted on (0: none, no WAIT), how
    long one WAIT waits, and the run's probe key."""

    replicas: int
    timeout_ms: int
    probe_key: str

    @classmethod
    def of(cls, settings: Any, probe_key: str) -> Durability:
        """From a run's settings or the `ShipConfig` its workers get (`redis_wait_*`)."""
        return cls(settings.redis_wait_replicas or 0, settings.redis_wait_timeout_ms, probe_key)

    def replicate(
        self,
        client: Any,
        write: Callable[[], Any],
        witness: Callable[[Any], None],
        what: str,
        holds: Callable[[list[Any]], bool] = all,
    ) -> Any:
        """Run `write`, then until replicated (see the module); returns what `write` returned
        the last time. `witness` adds reads to a pipeline; `holds` says, from their replies,
        whether the write is there (default: every reply truthy)."""
        result = write()
        while self.replicas and not self.held(client, witness, what, holds):
            log.warning("%s was lost in a failover before a replica had it; writing it again", what)
            result = write()
        return result

    async def replicate_async(
        self,
        client: Any,
        write: Callable[[], Awaitable[Any]],
        witness: Callable[[Any], None],
        what: str,
        holds: Callable[[list[Any]], bool] = all,
    ) -> Any:
        """`replicate` for an asyncio client."""
        result = await write()
        while self.replicas and not await self.held_async(client, witness, what, holds):
            log.warning("%s was lost in a failover before a replica had it; writing it again", what)
            result = await write()
        return result

    def held(
        self,
        client: Any,
        witness: Callable[[Any], None],
        what: str,
        holds: Callable[[list[Any]], bool] = all,
    ) -> bool:
        """Confirmation rounds until the replicas hold what `witness` finds (True), or it is
        found missing (False: lost in a failover). Also for something read, not written: the
        probe comes after it in the primary's replication stream all the same."""
        waiting = _Waiting(what, self.replicas)
        while True:
            pipe = client.pipeline(transaction=False)
            self._confirm(pipe, witness)
            verdict = waiting.verdict(holds, *pipe.execute())
            if verdict != _WAIT:
                return verdict == _DONE

    async def held_async(
        self,
        client: Any,
        witness: Callable[[Any], None],
        what: str,
        holds: Callable[[list[Any]], bool] = all,
        given_up: Callable[[], bool] = lambda: False,
    ) -> bool:
        """`held` for an asyncio client; waiting for replicas ends, False, once `given_up()`."""
        waiting = _Waiting(what, self.replicas)
        while True:
            pipe = client.pipeline(transaction=False)
            self._confirm(pipe, witness)
            verdict = waiting.verdict(holds, *await pipe.execute())
            if verdict != _WAIT or given_up():
                return verdict == _DONE

    def _confirm(self, pipe: Any, witness: Callable[[Any], None]) -> None:
        pipe.set(self.probe_key, time.time(), ex=PROBE_TTL_SECONDS)
        witness(pipe)
        pipe.wait(self.replicas, self.timeout_ms)


_LOST, _DONE, _WAIT = "lost", "done", "wait"


class _Waiting:
    """One write's confirmation rounds: what each round's replies mean, said in the log (a
    lost write; a wait for replicas, at most every few seconds, and when it ended)."""

    def __init__(self, what: str, replicas: int) -> None:
        self.what, self.replicas = what, replicas
        self.since: float | None = None
        self.logged = 0.0

    def verdict(self, holds: Callable[[list[Any]], bool], _probe: Any, *replies: Any) -> str:
        """From a round's replies (probe, witness reads, WAIT): lost, done, or wait."""
        *found, acknowledged = replies
        if not holds(found):
            return _LOST
        if acknowledged >= self.replicas:
            self.done()
            return _DONE
        self.short(acknowledged)
        return _WAIT

    def short(self, acknowledged: int) -> None:
        now = time.monotonic()
        self.since = self.since or now
        if now - self.logged >= SHORT_LOG_SECONDS:
            self.logged = now
            log.warning(
                "%s: %d of %d replicas acknowledged it (redis_wait_replicas); waiting for %.0f s so far "
                "(a replica is missing or rejoining after a failover)",
                self.what,
                acknowledged,
                self.replicas,
                now - self.since,
            )

    def done(self) -> None:
        if self.since is not None:
            log.info("%s: replicated after waiting %.1f s", self.what, time.monotonic() - self.since)
