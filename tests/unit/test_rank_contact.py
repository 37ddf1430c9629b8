"""Which rank the rank watch names (`orchestrator.rank_watch`), from the contact hash as its
writers write it (`transport.rank_contact.note_contact`, into a dict standing for the hash).
The case CI found: the one ship worker sends a step to rank 0, rank 0 acknowledges it at
once, then the same step is sent to rank 1, which had just died. Rank 1's last contact is
then the newest, but not its own: the dead rank is the one whose own last word is oldest."""

from __future__ import annotations

import time

from orchestrator.rank_watch import RankWatch
from transport.keys import RunKeys
from transport.rank_contact import ACKNOWLEDGED, READY, SENT, RankContact, note_contact


class HashPipe:
    """What `note_contact` queues on a pipeline, applied to a dict."""

    def __init__(self) -> None:
        self.hash: dict[bytes, bytes] = {}

    def hset(self, key: str, mapping: dict) -> None:
        self.hash.update({k.encode(): str(v).encode() for k, v in mapping.items()})

    def expire(self, key: str, seconds: int) -> None:
        return None


def watch(acknowledged: bool) -> RankWatch:
    found = RankWatch.__new__(RankWatch)
    found.acknowledged = acknowledged
    return found


def contacts_after_the_kill() -> dict[int, tuple[RankContact, float]]:
    pipe, keys = HashPipe(), RunKeys("run")
    for rank in (0, 1):
        note_contact(pipe, keys, rank, READY, address="127.0.0.1")
    time.sleep(0.01)
    note_contact(pipe, keys, 1, ACKNOWLEDGED, decoded=4)  # rank 1's last word; then it is killed
    time.sleep(0.01)
    note_contact(pipe, keys, 0, SENT, sent=5)
    time.sleep(0.01)
    note_contact(pipe, keys, 0, ACKNOWLEDGED, decoded=5)
    time.sleep(0.01)
    note_contact(pipe, keys, 1, SENT, sent=5)  # into the dead rank's socket or file
    return {contact.rank: (contact, 0.0) for contact in RankContact.read(pipe.hash, 2)}


def test_the_rank_whose_own_last_word_is_oldest_is_named():
    heard = contacts_after_the_kill()
    assert heard[1][0].at > heard[0][0].at, "the case: the dead rank's last contact is the newest"
    assert heard[1][0].heard < heard[0][0].heard
    assert watch(acknowledged=True)._longest_silent(0, heard) == 1
    assert watch(acknowledged=True)._longest_silent(1, heard) == 1
