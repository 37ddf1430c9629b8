"""Replay from Redis: the per-rank payloads the ship path retains until every rank has
acknowledged a step (see `PayloadStore.release_payloads`). A trainer rank that restarted,
or whose transport lost a message (a ship worker killed after its send returned but before
the bytes left the socket), reads the steps it is missing here instead of from the peer."""

from __future__ import annotations

import redis

from transport.store import PayloadMissingError, PayloadStore


class RetainedPayloads:
    """A `ReplaySource` over one run's retained payloads."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self.store = PayloadStore(client, run_id)

    def last_sent(self, rank: int) -> int:
        value = self.store.client.get(self.store.keys.last_sent(rank))
        return -1 if value is None else int(value)

    def payload(self, step: int, rank: int) -> bytes | None:
        try:
            return self.store.get_payload(step, rank)
        except PayloadMissingError:
            return None
