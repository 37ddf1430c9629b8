"""The orchestrator's restart point, written with every cut.

Redis already holds what the workers need (manifests, payloads, marks) and the records
published; what lives only in the orchestrator's memory is the rollouts it holds between
cuts and its counters. At each cut, in the same transaction as the manifest, it writes:

- `cursor`: every stream record up to here has been read;
- `open_rollouts`: the rollouts read so far whose group is still open (their records stay
  in the stream: the stream is trimmed only up to the oldest of them);
- `pending`: the trainable rollouts not yet cut, with their advantages (their groups are
  complete, so they cannot be rebuilt from the stream);
- `accounting`: the counters every record's conservation check rests on.

A restarted orchestrator restores these, re-reads the stream from its trimmed start,
takes again only the open rollouts among the records up to `cursor` and everything after
it, and so neither loses nor double-counts a rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from tasks.cohort import Cohort
from tasks.manifest import packb_in_pieces


def entry_order(entry_id: str) -> tuple[int, int]:
    """A Redis stream id ("ms-seq") as a comparable pair."""
    millis, _, sequence = entry_id.partition("-")
    return int(millis), int(sequence or 0)


@dataclass(frozen=True)
class Checkpoint:
    cursor: str
    open_rollouts: frozenset[str]
    pending: Cohort
    accounting: dict[str, Any]

    def covers(self, entry_id: str) -> bool:
        """Whether the record was read before the checkpoint was taken."""
        return entry_order(entry_id) <= entry_order(self.cursor)

    def to_bytes(self) -> bytes:
        return packb_in_pieces(
            {
                "cursor": self.cursor,
                "open_rollouts": sorted(self.open_rollouts),
                "pending": self.pending.to_wire(),
                "accounting": self.accounting,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Checkpoint:
        fields = msgpack.unpackb(data, raw=False)
        return cls(
            cursor=fields["cursor"],
            open_rollouts=frozenset(fields["open_rollouts"]),
            pending=Cohort.from_wire(fields["pending"]),
            accounting=fields["accounting"],
        )
