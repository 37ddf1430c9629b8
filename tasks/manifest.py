"""The step manifest: everything the workers need to ship one step, written once by the
orchestrator at the cut and read by every stage. Tasks carry only (run_id, step[, rank]);
the manifest carries the keys and scalars. Its stored form opens with its cut's id
(`HEAD_BYTES`), so a process holding a step's manifest can tell from those bytes alone that
it is still the step's (a step found empty is cut again under the same number)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgpack
import numpy as np

from tasks.cohort import Cohort
from tasks.stages.record_names import PRIME_RL_559B447, RecordNames
from transport.keys import RunKeys
from transport.payload_dir import PayloadDirectory, payload_directory
from transport.payload_segments import PAYLOAD_FIELD, RunRows, SideArrays
from transport.schema import WIRE_559B447, WIRE_PROFILES, WireProfile

# The stored manifest's first bytes: the map's header and its first entry, the cut's id.
HEAD_BYTES = 64

# Elements of a long list packed in one call by `packb_in_pieces`: about a millisecond of labels.
PIECE_ITEMS = 2048


def packb_in_pieces(value: Any) -> bytes:
    """`msgpack.packb(value, use_bin_type=True)`, byte for byte, in many short calls.

    One `packb` of a 16k-rollout manifest holds the GIL for 15-20 ms; the orchestrator packs
    it on its publisher thread, and the event loop gets the GIL back between two pieces
    (maps are walked, lists longer than PIECE_ITEMS packed a slice at a time)."""
    pieces: list[bytes] = []
    _pack_pieces(msgpack.Packer(use_bin_type=True), value, pieces)
    return b"".join(pieces)


def _pack_pieces(packer: msgpack.Packer, item: Any, pieces: list[bytes]) -> None:
    """A module function, not a closure over `pieces`: a recursive closure is a reference
    cycle that kept every step's packed manifest alive until the cyclic collector ran (the
    orchestrator's traced memory grew by the manifest's size a step, test_bounded_accounting)."""
    if isinstance(item, dict):
        pieces.append(packer.pack_map_header(len(item)))
        for key, inner in item.items():
            pieces.append(packer.pack(key))
            _pack_pieces(packer, inner, pieces)
    elif isinstance(item, list) and len(item) > PIECE_ITEMS:
        pieces.append(packer.pack_array_header(len(item)))
        for start in range(0, len(item), PIECE_ITEMS):
            piece = item[start : start + PIECE_ITEMS]
            pieces.append(packer.pack(piece)[len(packer.pack_array_header(len(piece))) :])
    else:
        pieces.append(packer.pack(item))


@dataclass(frozen=True)
class ShipConfig:
    """Where and how a step is shipped; fixed for a run."""

    ranks: int
    seq_len: int
    transport: Literal["zmq", "fs"] = "zmq"
    zmq_host: str = "127.0.0.1"
    zmq_port: int = 5555
    zmq_curve: bool = False  # CURVE sockets admitting only the keys in zmq_keys_dir (transport.zmq_curve)
    zmq_keys_dir: str = ""
    output_dir: str = "runs/default"
    pad_to_multiple: int = 1
    vocab_size: int = 1 << 31
    cpu_queue: str = "cpu"
    ship_queue: str = "ship"
    samples_per_step: int = 0
    replay_steps: int = 8
    first_step: int = 0  # the run's numbering, for the off-policy staleness of what ships
    bind_wait_seconds: float = 5.0  # a ZMQ port held by another process: wait, then stop the run
    redis_wait_replicas: int = 0  # replicas that acknowledge the marks exactly-once depends on
    redis_wait_timeout_ms: int = 1000
    wire: str = WIRE_559B447.name  # the trainers' MicroBatch layout (`WIRE_PROFILES`)
    payload_root: str = ""  # where side arrays by handle may be ("": anywhere)
    payload_store: Literal["redis", "dir"] = "redis"  # where per-rank payloads are retained
    dedupe_horizon: int = 1 << 16  # rollouts whose outcome the run remembers (transport.outcomes)
    file_mode: str = "owner"  # who may read the run's files (transport.run_files)
    record_names: RecordNames = PRIME_RL_559B447  # the record's naming scheme (tasks.stages.record_names)

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir)

    @property
    def wire_profile(self) -> WireProfile:
        return WIRE_PROFILES[self.wire]

    def payload_directory(self, run_id: str) -> PayloadDirectory | None:
        """Where the run's per-rank payloads are retained, if not in Redis."""
        return payload_directory(self.output_path, run_id) if self.payload_store == "dir" else None

    def run_rows(self, run_id: str) -> RunRows | None:
        return RunRows(Path(self.payload_root), run_id) if self.payload_root else None

    @property
    def side_arrays(self) -> SideArrays:
        carried = self.wire_profile.carries(PAYLOAD_FIELD)
        return SideArrays(self.payload_root or None, None if carried else self.wire, self.file_mode)


@dataclass
class StepManifest:
    """One cut step.

    `effective` holds the rollouts cut for training (the workers may still drop a rollout
    whose payload is unusable); `window` holds every rollout finalized since the previous
    cut, whatever became of it, for the `all` statistics. `counters` carries the
    orchestrator's accounting and progress totals; `loop_lag_ms` the event-loop lag
    observations since the previous cut; `policy_wait` the seconds the policy gate held
    this step before its cut (the record's `time/wait_for_policy`: the step's own wait,
    whichever step is published meanwhile).
    """

    run_id: str
    step: int
    prev_step: int
    cut_time: float
    config: ShipConfig
    effective: Cohort
    window: Cohort
    counters: dict[str, float] = field(default_factory=dict)
    loop_lag_ms: np.ndarray = field(default_factory=lambda: np.zeros(0))
    policy_wait: float = 0.0
    cut_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # this cut's, whatever its step

    @property
    def keys(self) -> RunKeys:
        return RunKeys(self.run_id)

    def to_bytes(self) -> bytes:
        return packb_in_pieces(
            {
                "cut_id": self.cut_id,  # first: within `HEAD_BYTES`
                "run_id": self.run_id,
                "step": self.step,
                "prev_step": self.prev_step,
                "cut_time": self.cut_time,
                "config": self.config.__dict__,
                "effective": self.effective.to_wire(),
                "window": self.window.to_wire(),
                "counters": self.counters,
                "loop_lag_ms": np.asarray(self.loop_lag_ms, dtype=np.float64).tobytes(),
                "policy_wait": self.policy_wait,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> StepManifest:
        raw: dict[str, Any] = msgpack.unpackb(data, raw=False)
        return cls(
            run_id=raw["run_id"],
            step=raw["step"],
            prev_step=raw["prev_step"],
            cut_time=raw["cut_time"],
            config=ShipConfig(**raw["config"]),
            effective=Cohort.from_wire(raw["effective"]),
            window=Cohort.from_wire(raw["window"]),
            counters=raw["counters"],
            loop_lag_ms=np.frombuffer(raw["loop_lag_ms"], dtype=np.float64),
            policy_wait=raw["policy_wait"],
            cut_id=raw["cut_id"],
        )
