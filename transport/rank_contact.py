"""Each trainer rank's last contact with the run, in its `rank_contact` hash: so that a rank
that died or hung is named with where and when it was last seen (`rlship status`, and the
orchestrator's `rank_timeout`), not only as a step that makes no progress.

Three things are contact, each written by whoever sees it: a READY heard by the ZMQ sender
(with the address it came from), a step that left the ship worker for the rank, and a step
the rank decoded and acknowledged (rlship's trainers, with their host and pid). Fields per
rank: `{rank}:at` (unix time), `{rank}:how` (`ready`, `sent`, `acknowledged`),
`{rank}:address`, `{rank}:sent` and `{rank}:decoded` (the last step of each), and
`{rank}:heard` (unix time of the last contact that came from the rank itself, a READY or an
acknowledgement: a step sent to a rank that has just died is contact too, but not its own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from transport.keys import DEFAULT_TTL_SECONDS, RunKeys

READY, SENT, ACKNOWLEDGED = "ready", "sent", "acknowledged"


def note_contact(pipe: Any, keys: RunKeys, rank: int, how: str, **fields: int | str) -> None:
    """Queue on `pipe` the rank's contact now: `how`, and `address`, `sent` or `decoded`."""
    now = time.time()
    values = {f"{rank}:at": now, f"{rank}:how": how} | {f"{rank}:{k}": v for k, v in fields.items()}
    if how != SENT:
        values[f"{rank}:heard"] = now
    pipe.hset(keys.rank_contact, mapping=values)
    pipe.expire(keys.rank_contact, DEFAULT_TTL_SECONDS)


@dataclass(frozen=True)
class RankContact:
    """A rank's last contact as the hash holds it; None where nothing was written yet."""

    rank: int
    at: float | None = None
    how: str | None = None
    address: str | None = None
    sent: int | None = None
    decoded: int | None = None
    heard: float | None = None  # the last contact from the rank itself

    @classmethod
    def read(cls, raw: dict[bytes, bytes], ranks: int) -> list[RankContact]:
        """Every rank's, from the hash's raw fields (HGETALL)."""
        fields = {k.decode(): v.decode() for k, v in raw.items()}

        def get(rank: int, name: str) -> str | None:
            return fields.get(f"{rank}:{name}")

        contacts = []
        for rank in range(ranks):
            at, sent, decoded = get(rank, "at"), get(rank, "sent"), get(rank, "decoded")
            heard = get(rank, "heard")
            contacts.append(
                cls(
                    rank,
                    None if at is None else float(at),
                    get(rank, "how"),
                    get(rank, "address"),
                    None if sent is None else int(sent),
                    None if decoded is None else int(decoded),
                    None if heard is None else float(heard),
                )
            )
        return contacts

    def describe(self, now: float) -> str:
        """`last contact 2.1 s ago (acknowledged), last step decoded 4, sent 5, seen at 127.0.0.1`."""
        if self.at is None:
            return "never in contact"
        return (
            f"last contact {max(0.0, now - self.at):.1f} s ago ({self.how}), last step decoded "
            f"{_step(self.decoded)}, sent {_step(self.sent)}, last seen at {self.address or 'unknown'}"
        )


def _step(value: int | None) -> str:
    return "none" if value is None else str(value)
