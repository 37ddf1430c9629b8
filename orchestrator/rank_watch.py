"""The rank watch: a trainer rank the run waits on and has not heard from for `rank_timeout`
seconds stops the run, in one line naming the rank, its last step and where it was last
seen (`transport.rank_contact`), rather than the run waiting on a dead rank for ever.

The run waits on a rank when a step encoded for it has not been sent to it (a rank that
left: its subscription is gone, or it never announced READY), or when the policy gate holds
for a step the rank has not acknowledged (with acknowledgements in Redis: rlship's
trainers). Contact is timed by this process's clock, from when it saw the rank's contact
change (a READY, a step sent, a step acknowledged), and never from before the wait began:
a rank idle while the run needed nothing of it is not late.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from orchestrator.errors import RankSilent
from orchestrator.gate import PolicyGate
from orchestrator.settings import RunSettings
from orchestrator.waits import event_set_within
from transport.keys import RunKeys
from transport.rank_contact import RankContact

WATCH_SECONDS = 1.0  # how often the watch looks


class RankWatch:
    def __init__(
        self,
        settings: RunSettings,
        client: aioredis.Redis,
        gate: PolicyGate,
        stopping: asyncio.Event,
        in_flight: Callable[[], range],
        on_fatal: Callable[[Exception], None],
    ) -> None:
        self.settings = settings
        self.client = client
        self.keys = RunKeys(settings.run_id)
        self.gate = gate
        self.stopping = stopping
        self.in_flight = in_flight  # the steps cut and not yet published
        self.on_fatal = on_fatal
        # Acknowledgements in Redis say which rank holds the gate; broadcasts do not.
        self.acknowledged = gate.policy.source in ("redis", "both")

    async def watch(self) -> None:
        """Every `WATCH_SECONDS` until the run stops: stop it once a rank it waits on has been
        silent for `rank_timeout` (off at 0)."""
        if not self.settings.rank_timeout:
            return
        heard: dict[int, tuple[RankContact, float]] = {}  # rank -> its contact, seen since
        waiting_since: dict[int, float] = {}
        while not self.stopping.is_set():
            await event_set_within(self.stopping, WATCH_SECONDS)
            raw, waits = await self._read()
            now = time.monotonic()
            for contact in RankContact.read(raw, self.settings.ranks):
                if contact.rank not in heard or heard[contact.rank][0] != contact:
                    heard[contact.rank] = (contact, now)
            for rank in [r for r in waiting_since if r not in waits]:
                del waiting_since[rank]
            for rank, why in sorted(waits.items()):
                since = max(heard[rank][1], waiting_since.setdefault(rank, now))
                if now - since >= self.settings.rank_timeout:
                    culprit = self._longest_silent(rank, {r: heard[r] for r in waits})
                    waiting = f"on it ({why})" if culprit == rank else f"(rank {rank}: {why})"
                    self.on_fatal(self._silent(culprit, waiting, now - since, heard))
                    return

    def _longest_silent(self, rank: int, heard: dict[int, tuple[RankContact, float]]) -> int:
        """The rank to name when `rank` is found silent: of the ranks the run waits on, the one
        whose last contact is oldest (by the contact's own time: this watch looks once a
        second, too coarse to order them). The one ship worker sends to the ranks in turn, so
        a send stuck on a dead rank leaves the live ones unsent too; the dead one is the one
        silent longest. A rank the run does not wait on is never named, however long ago its
        last contact: over files a live rank that decoded every step it was given is silent
        while the gate waits for a dead one's acknowledgement. With acknowledgements the
        ranks are ordered by their own last word (`heard`): the one ship worker sends a step to
        the ranks in turn, so a step sent to a dead rank right after a live one acknowledged
        it would otherwise make the dead rank the one heard from last."""

        def last(r: int) -> float:
            contact = heard[r][0]
            own = contact.heard if self.acknowledged else None
            return own if own is not None else (contact.at or float("-inf"))

        return min(heard, key=lambda r: (last(r), r != rank))

    def _silent(
        self, rank: int, why: str, waited: float, heard: dict[int, tuple[RankContact, float]]
    ) -> RankSilent:
        contact, since = heard[rank]
        silent = max(waited, time.monotonic() - since)
        return RankSilent(
            f"trainer rank {rank} silent for {silent:.0f} s (rank_timeout "
            f"{self.settings.rank_timeout:g}) while the run waits {why}: "
            f"{contact.describe(time.time())}"
        )

    async def _read(self) -> tuple[dict[bytes, bytes], dict[int, str]]:
        """The contact hash, and the ranks the run waits on now with what it waits for."""
        steps = self.in_flight()
        ranks = range(self.settings.ranks)
        awaited = self.gate.awaited_step if self.acknowledged else None
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.keys.rank_contact)
        for step in steps:
            pipe.smembers(self.keys.sent(step))
            for rank in ranks:
                pipe.exists(self.keys.done(step, "encode", rank))
        if awaited is not None:
            pipe.smembers(self.keys.trained(awaited))
        raw, *replies = await pipe.execute()
        waits: dict[int, str] = {}
        for index, step in enumerate(steps):
            sent, *encoded = replies[index * (len(ranks) + 1) : (index + 1) * (len(ranks) + 1)]
            for rank in ranks:
                if encoded[rank] and str(rank).encode() not in sent:
                    waits.setdefault(rank, f"step {step} encoded for it and not sent")
        if awaited is not None:
            acknowledged = {int(r) for r in replies[-1]}
            for rank in set(ranks) - acknowledged:
                waits.setdefault(rank, f"the policy gate waits for its acknowledgement of step {awaited}")
        return raw, waits
