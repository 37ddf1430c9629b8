"""READY announcements that outlive the sender that heard them.

prime-rl's trainer ranks announce READY once, when they start. A ship worker that dies
and is replaced binds again and would wait for a READY that never comes; keeping every
announcement in Redis under the run lets the replacement treat an announced rank as ready
as soon as its subscription arrives (a SUB socket resubscribes by itself on reconnect).
"""

from __future__ import annotations

import redis

from transport.keys import RunKeys
from transport.rank_contact import READY, note_contact

# Longer than any run between two sender starts; refreshed whenever a sender starts or
# hears a READY, so only an abandoned run's set expires.
ANNOUNCEMENT_TTL_SECONDS = 7 * 24 * 3600


class RedisAnnouncements:
    """An `AnnouncementLog` kept in the run's `announced_ranks` set."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self.client = client
        self.keys = RunKeys(run_id)
        self.key = self.keys.announced_ranks

    def load(self) -> set[int]:
        pipe = self.client.pipeline(transaction=False)
        pipe.smembers(self.key)
        pipe.expire(self.key, ANNOUNCEMENT_TTL_SECONDS)
        members, _ = pipe.execute()
        return {int(member) for member in members}

    def add(self, rank: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(self.key, rank)
        pipe.expire(self.key, ANNOUNCEMENT_TTL_SECONDS)
        pipe.execute()

    def heard(self, rank: int, address: str) -> None:
        """Every READY is contact (`transport.rank_contact`): the rank lives, at `address`."""
        pipe = self.client.pipeline(transaction=False)
        note_contact(pipe, self.keys, rank, READY, address=address)
        pipe.execute()
