"""What every step transport shares: the received-message record, the sender and receiver
protocols, and the one place that decides delivery order on the receiving side.

Transports move opaque payload bytes per (step, rank); they never decode them. Delivery to
a trainer rank is at-least-once upstream (a Celery task can run twice, a replacement ship
worker can resend), so the receiver, not the sender, enforces "each step once, in order".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, Self, runtime_checkable

logger = logging.getLogger("rlship.transport")

Payload = bytes | bytearray | memoryview
"""What a sender accepts: any contiguous buffer (the ZMQ sender sends it without copying)."""


@dataclass(frozen=True, slots=True)
class ReceivedStep:
    """One rank's payload for one step, as the transport delivered it (still encoded)."""

    step: int
    rank: int
    payload: bytes | memoryview


@runtime_checkable
class StepSender(Protocol):
    """Sends one encoded payload per (step, rank): `send` returns once it has left the
    process; `hand_over` returns as soon as it may, and `wait_left` waits until it has left,
    so that the payloads of several ranks handed over in turn leave side by side."""

    def send(self, step: int, rank: int, payload: Payload) -> None: ...

    def hand_over(self, step: int, rank: int, payload: Payload) -> None: ...

    def wait_left(self, step: int, rank: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class StepReceiver(Protocol):
    """Receives one rank's payloads in step order; `None` from `receive` means timeout."""

    @property
    def rank(self) -> int: ...

    @property
    def next_step(self) -> int: ...

    @property
    def duplicates_dropped(self) -> int: ...

    @property
    def foreign_dropped(self) -> int:
        """Steps of another run that reached this rank and were dropped."""
        ...

    @property
    def gaps(self) -> list[tuple[int, int]]: ...

    def receive(self, timeout: float | None = None) -> ReceivedStep | None: ...

    def close(self) -> None: ...


@runtime_checkable
class ReplaySource(Protocol):
    """Where a receiver gets again a step its transport lost: the sender's retained payloads.

    `last_sent(rank)` is the newest step the sender has handed to the transport for `rank`;
    `payload(step, rank)` is that step's bytes, or None once they are no longer retained.
    """

    def last_sent(self, rank: int) -> int: ...

    def payload(self, step: int, rank: int) -> bytes | None: ...


class StepSequencer:
    """Receiver-side ordering, shared by every receiver so they agree on what is a duplicate.

    - step == next_step: delivered.
    - step > next_step: delivered, but the skipped range is recorded in `gaps` as
      (expected, got) and logged at ERROR (the trainer would otherwise silently miss steps).
    - step < next_step that was delivered (or precedes the initial `next_step`, i.e. was
      delivered before a restart): a duplicate (a redelivered task, a resending replacement
      worker); dropped, counted in `duplicates_dropped`, logged at WARNING once per step.
    - step < next_step inside a recorded gap: it was never delivered but arrives after a later
      step, so delivering it would break order; dropped, counted in `late_dropped`, ERROR.

    After delivering step s, next_step = s + 1.
    """

    _MAX_WARNED = 4096  # bound on remembered duplicate steps, so a long run cannot grow it

    def __init__(self, rank: int, next_step: int) -> None:
        if next_step < 0:
            raise ValueError(f"next_step must be >= 0, got {next_step}")
        self.rank = rank
        self.next_step = next_step
        self.duplicates_dropped = 0
        self.late_dropped = 0
        self.gaps: list[tuple[int, int]] = []
        self._warned: set[int] = set()

    def admit(self, step: int) -> bool:
        """Whether `step` is to be delivered now; updates the counters and `next_step`."""
        if step >= self.next_step:
            if step > self.next_step:
                self.gaps.append((self.next_step, step))
                logger.error(
                    "rank %d: step gap, expected step %d but got %d (steps %d..%d never delivered)",
                    self.rank,
                    self.next_step,
                    step,
                    self.next_step,
                    step - 1,
                )
            self.next_step = step + 1
            return True
        if any(expected <= step < got for expected, got in self.gaps):
            self.late_dropped += 1
            logger.error(
                "rank %d: step %d arrived after step %d was delivered; dropped to keep order",
                self.rank,
                step,
                self.next_step - 1,
            )
            return False
        self.duplicates_dropped += 1
        if step not in self._warned:
            if len(self._warned) >= self._MAX_WARNED:
                self._warned.clear()
            self._warned.add(step)
            logger.warning(
                "rank %d: duplicate step %d dropped (next expected step is %d)",
                self.rank,
                step,
                self.next_step,
            )
        return False


class Closeable:
    """Context-manager support for the transports: `with` closes them."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SequencedReceiver(Closeable):
    """A receiver's step bookkeeping, read from its StepSequencer."""

    _sequencer: StepSequencer

    @property
    def rank(self) -> int:
        return self._sequencer.rank

    @property
    def next_step(self) -> int:
        return self._sequencer.next_step

    @property
    def duplicates_dropped(self) -> int:
        return self._sequencer.duplicates_dropped

    @property
    def late_dropped(self) -> int:
        return self._sequencer.late_dropped

    @property
    def gaps(self) -> list[tuple[int, int]]:
        return self._sequencer.gaps
