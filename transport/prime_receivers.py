"""prime-rl's trainer receivers, with what the stock ones lack: exactly once, in order.

prime-rl's trainer drives a `MicroBatchReceiver` (src/prime_rl/transport/): constructed
for a data rank and the step it trains next, then `wait()`, `can_receive()`, `receive()`
(that step's micro-batches), `ack(step)` and `close()`. Its ZMQ receiver counts messages
and has no duplicate check or replay, so a step sent twice is trained twice and a step
lost in flight shifts every later one. These classes keep the interface and the names,
so a prime-rl user switches one import:

    from transport.prime_receivers import ZMQMicroBatchReceiver  # was prime_rl.transport.zmq

and underneath run rlship's receivers: the step comes from the topic (so `current_step`
is the step number on the wire), a duplicate is dropped, a gap or a last step lost in
flight is replayed from the payloads rlship retains in Redis, and a rank that restarts
from a checkpoint catches up from there before anything newer. Each step received is
acknowledged in the run's Redis, as rlship's own trainer does (the ship path then
releases its retained payloads, and the policy version moves when every rank has it).

The run is named by arguments or by the environment rlship's processes share:
`RLSHIP_RUN_ID`, `REDIS_URL`, `RLSHIP_RANKS`, `RLSHIP_FIRST_STEP` (default 1: prime-rl
numbers its steps from 1, and the policy version acknowledged after step s is s) and
`RLSHIP_WIRE` (unset: as the run derives it from `RLSHIP_WORKLOAD`); the ZMQ receiver also
`RLSHIP_ZMQ_CURVE` and `RLSHIP_ZMQ_KEYS_DIR` (a run's CURVE: it connects with the rank's key
pair and the ship worker's public key from that directory). `receive()` returns
what `decode` makes of the payload: prime-rl's own `MicroBatch` structs when prime-rl is
installed (its msgspec decoder, as its receivers do), rlship's `MicroBatch` list otherwise.
Side arrays the step points at by handle (wire prime-rl-0f59b24) are read once on receipt,
as the trainer will read them, so a missing or short file fails `receive()` naming it, and
the rows' checksum is recorded beside the payload's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict, Unpack

from transport.base import ReceivedStep, StepReceiver
from transport.codec import decode_microbatches
from transport.connection import connect_redis
from transport.filesystem import FileReceiver
from transport.keys import RunKeys
from transport.numbering import PRIME_RL_FIRST_STEP
from transport.payload_segments import read_side_arrays
from transport.replay import RetainedPayloads
from transport.schema import WIRE_559B447, WIRE_PROFILES, WireProfile, default_wire
from transport.trainer import Acknowledgements
from transport.zmq_curve import client_keys
from transport.zmq_receiver import ZMQReceiver

log = logging.getLogger("rlship.trainer")

Decode = Callable[[bytes | memoryview], Any]
FOREIGN_REPORT_SECONDS = 0.5  # a waiting rank puts its count of foreign steps in Redis this often


def default_decode(wire: WireProfile = WIRE_559B447) -> Decode:
    """prime-rl's msgspec decoder of `list[MicroBatch]` if prime-rl is importable (where its
    MicroBatch lives at the wire's commit), else ours."""
    try:
        import msgspec

        if wire is WIRE_559B447:
            from prime_rl.transport.types import MicroBatch  # type: ignore[import-not-found]
        else:
            from prime_rl.transports.batch.types import MicroBatch  # type: ignore[import-not-found]
    except ImportError:
        return lambda payload: decode_microbatches(payload, wire)
    return msgspec.msgpack.Decoder(type=list[MicroBatch]).decode


def _setting(value: Any, env: str, default: Any = None) -> Any:
    if value is not None:
        return value
    if os.environ.get(env):  # rlship passes an unset setting on as an empty variable
        return os.environ[env]
    if default is None:
        raise ValueError(f"{env}: not set; pass it as an argument or set the environment variable")
    return default


def run_id_setting(run: ReceiverRunSettings) -> str:
    """The run a receiver belongs to: it takes only that run's steps."""
    return str(_setting(run.get("run_id"), "RLSHIP_RUN_ID"))


class ReceiverRunSettings(TypedDict, total=False):
    """The run a receiver acknowledges in; a setting left out or None is read from the
    environment (`_setting`)."""

    run_id: str | None
    redis_url: str | None
    ranks: int | None
    decode: Decode | None
    first_step: int | None
    wire: str | None


class ExactlyOnceReceiver:
    """The MicroBatchReceiver interface over one of rlship's step receivers, which it owns:
    it is closed with this one, or at once if the run's settings cannot be read."""

    def __init__(self, receiver: StepReceiver, data_rank: int, **run: Unpack[ReceiverRunSettings]) -> None:
        self.data_rank = data_rank
        self._receiver = receiver
        try:
            unexpected = sorted(run.keys() - ReceiverRunSettings.__annotations__.keys())
            if unexpected:  # **run would otherwise take a misspelt setting silently
                raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments {unexpected}")
            workload = os.environ.get("RLSHIP_WORKLOAD") or "dense"
            wire = str(_setting(run.get("wire"), "RLSHIP_WIRE", default_wire(workload).name))
            if wire not in WIRE_PROFILES:
                raise ValueError(f"wire: {wire!r} is not one of {', '.join(WIRE_PROFILES)}")
            self._decode = run.get("decode") or default_decode(WIRE_PROFILES[wire])
            self.client = connect_redis(
                _setting(run.get("redis_url"), "REDIS_URL", "redis://127.0.0.1:6379/0")
            )
            self.run_id = run_id_setting(run)
            ranks = int(_setting(run.get("ranks"), "RLSHIP_RANKS"))
            if not 0 <= data_rank < ranks:
                allowed = f"ranks={ranks}: 0 to {ranks - 1}"
                raise ValueError(f"data_rank: {data_rank} is not a rank of run {self.run_id} ({allowed})")
            if not self.client.exists(RunKeys(self.run_id).run_marker):
                log.warning(
                    "run %s is not in Redis (yet): waiting for its steps; is the run id right?", self.run_id
                )
            self._acknowledgements = Acknowledgements(
                self.client,
                self.run_id,
                ranks,
                int(_setting(run.get("first_step"), "RLSHIP_FIRST_STEP", PRIME_RL_FIRST_STEP)),
            )
        except BaseException:
            receiver.close()
            raise
        self._pending: ReceivedStep | None = None

    @property
    def current_step(self) -> int:
        """The step `receive()` returns next."""
        return self._receiver.next_step if self._pending is None else self._pending.step

    @property
    def duplicates_dropped(self) -> int:
        return self._receiver.duplicates_dropped

    def wait(self) -> None:
        """Block until the next step can be received."""
        while self._pending is None:
            self._pending = self._receiver.receive(timeout=FOREIGN_REPORT_SECONDS)
            self._acknowledgements.report_foreign(self._receiver)

    def can_receive(self) -> bool:
        """Whether `receive()` would return without waiting."""
        if self._pending is None:
            self._pending = self._receiver.receive(timeout=0)
            self._acknowledgements.report_foreign(self._receiver)
        return self._pending is not None

    def receive(self) -> Any:
        """The next step's micro-batches (each step once, in order), acknowledged in Redis."""
        self.wait()
        assert self._pending is not None
        message, self._pending = self._pending, None
        micro_batches = self._decode(message.payload)
        self._acknowledgements.record_rows(message, read_side_arrays(micro_batches))
        self._acknowledgements.acknowledge(message)
        return micro_batches

    def ack(self, step: int) -> None:
        """prime-rl's consumption ack: the step was acknowledged in Redis when received."""

    def close(self) -> None:
        self._receiver.close()
        self.client.close()


def curve_setting(zmq_curve: bool | None) -> bool:
    """Whether the run's ZMQ sockets speak CURVE: the argument, else `RLSHIP_ZMQ_CURVE` (as
    rlship passes a setting on: `True`/`False`, or 1, yes)."""
    if zmq_curve is not None:
        return zmq_curve
    return os.environ.get("RLSHIP_ZMQ_CURVE", "").strip().lower() in ("1", "true", "yes")


class ZMQMicroBatchReceiver(ExactlyOnceReceiver):
    """prime-rl's ZMQMicroBatchReceiver(output_dir, data_rank, current_step, transport),
    `transport` being its ZMQ transport config (`host`, `port`, `hwm`). With `zmq_curve`
    (else `RLSHIP_ZMQ_CURVE`) it connects as a CURVE client with `rank-{r}.key_secret` and
    `server.key` from `zmq_keys_dir` (else `RLSHIP_ZMQ_KEYS_DIR`, else `{output_dir}/keys`)."""

    def __init__(
        self,
        output_dir: Path,
        data_rank: int,
        current_step: int,
        transport: Any,
        *,
        replay_after: float = 1.0,
        zmq_curve: bool | None = None,
        zmq_keys_dir: Path | None = None,
        **run: Unpack[ReceiverRunSettings],
    ) -> None:
        self.output_dir = Path(output_dir)
        run["run_id"] = run_id_setting(run)
        keys_dir = Path(_setting(zmq_keys_dir, "RLSHIP_ZMQ_KEYS_DIR", self.output_dir / "keys"))
        receiver = ZMQReceiver(
            transport.host,
            transport.port,
            data_rank,
            run_id=run["run_id"],
            next_step=current_step,
            hwm=getattr(transport, "hwm", 64),
            replay_after=replay_after,
            curve=client_keys(keys_dir, data_rank) if curve_setting(zmq_curve) else None,
        )
        super().__init__(receiver, data_rank, **run)
        receiver.replay = RetainedPayloads(self.client, self.run_id)


class FileSystemMicroBatchReceiver(ExactlyOnceReceiver):
    """prime-rl's FileSystemMicroBatchReceiver(output_dir, data_rank, current_step): reads
    `{output_dir}/rollouts/step_{n}/rank_{r}.bin` in step order (files stay, so nothing
    needs replaying; a restarted rank reads on from its `current_step`)."""

    def __init__(
        self,
        output_dir: Path,
        data_rank: int,
        current_step: int,
        *,
        poll_interval: float = 0.05,
        **run: Unpack[ReceiverRunSettings],
    ) -> None:
        self.output_dir = Path(output_dir)
        run["run_id"] = run_id_setting(run)
        receiver = FileReceiver(
            output_dir, data_rank, run_id=run["run_id"], next_step=current_step, poll_interval=poll_interval
        )
        super().__init__(receiver, data_rank, **run)
