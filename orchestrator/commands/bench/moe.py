"""`rlship bench loop --workload moe`: the variants it compares and the rollouts they share.

Each variant is a placement and the run settings it ships under (`VARIANTS`); its
`workload` setting says how each rollout's routed experts (a `[tokens, 48, 8]` uint8 array,
384 bytes a token) reach the ship path: not at all (`dense`), in a rows file under the
payload root and passed by handle (`moe`, on wire prime-rl-0f59b24), or inline in its
arrays (`moe-inline`: through Redis, or with `payload_store` `dir` through the run's files).
A variant more is one entry more in `VARIANTS`.

Every variant ships the same rollouts: the bench makes each step once with
`SyntheticWorkload` (routed experts inline) and keeps it in a `StepCache`; a variant's
producer (or, for the thread placement, its process) reads it from there and passes the
routed experts on its own way (`routed_experts_as`). Dense rollouts are the same rollouts
without them, so a dense step's tokens are a moe step's.
"""

from __future__ import annotations

import dataclasses
import mmap
import pickle
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.commands.produce import MOE_LAYERS, MOE_TOPK
from orchestrator.records import RolloutRecord
from transport.checksum import payload_checksum
from transport.payload_segments import (
    PAYLOAD_FIELD,
    PayloadSegment,
    RunRows,
    rollout_rows_path,
    write_segment_file,
)

EXPERTS = "routed_experts"
ROW_BYTES = MOE_LAYERS * MOE_TOPK  # uint8 per token
# How each workload setting passes a rollout's routed experts to the ship path.
EXPERTS_OF_WORKLOAD = {"dense": "none", "moe": "handle", "moe-inline": "inline"}

Rollout = tuple[RolloutRecord, dict[str, Any]]


@dataclass(frozen=True)
class Variant:
    """A placement and the run settings it ships under (`RunSettings` names)."""

    placement: str
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def workload(self) -> str:
        return str(self.settings.get("workload", "dense"))

    @property
    def routed_experts(self) -> str:
        """none, handle or inline."""
        return EXPERTS_OF_WORKLOAD[self.workload]

    def describe(self) -> dict[str, Any]:
        return {"placement": self.placement, "routed_experts": self.routed_experts, **self.settings}


VARIANTS: dict[str, Variant] = {
    # prime-rl's orchestrator: the arrays in its memory, the routed experts encoded inline.
    "thread-moe-inline": Variant("thread", {"workload": "moe-inline"}),
    "thread-dense": Variant("thread", {"workload": "dense"}),
    # rlship: the same rollouts without routed experts (the baseline of the goals' ratios),
    # with them by handle, and inline through Redis or through the run's directory.
    "celery-dense": Variant("celery", {"workload": "dense"}),
    "celery-moe-handle": Variant("celery", {"workload": "moe"}),
    "celery-moe-inline": Variant("celery", {"workload": "moe-inline"}),
    "celery-moe-inline-dir": Variant("celery", {"workload": "moe-inline", "payload_store": "dir"}),
    "celery-moe-handle-dir": Variant("celery", {"workload": "moe", "payload_store": "dir"}),
    # The dense step with its per-rank payloads in the run's files (one host shared by the
    # workers and the ranks): what the payloads' trip through Redis costs the trainers.
    "celery-dense-dir": Variant("celery", {"workload": "dense", "payload_store": "dir"}),
}
DEFAULT_VARIANTS: tuple[str, ...] = (
    "thread-moe-inline",
    "celery-dense",
    "celery-moe-handle",
    "celery-moe-inline",
    "celery-moe-inline-dir",
)


def without_experts(arrays: Mapping[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in arrays.items() if name != EXPERTS}


def by_handle(rollouts: list[Rollout], rows: RunRows) -> list[Rollout]:
    """Each rollout's routed experts written to its own rows file in the run's directory
    under the payload root and passed on by handle, as the moe producer does
    (`SyntheticWorkload(moe_rows=...)`)."""
    rows.directory.mkdir(parents=True, exist_ok=True)
    out = []
    for record, arrays in rollouts:
        path = rollout_rows_path(rows.root, rows.run_id, record.rollout_id)
        segments = write_segment_file(path, {EXPERTS: arrays[EXPERTS]})
        out.append((record, without_experts(arrays) | {PAYLOAD_FIELD: segments}))
    return out


def handle_segments(rollouts: list[Rollout], rows: RunRows) -> dict[str, list[PayloadSegment]]:
    """The segments `by_handle` hands on, made without writing a file: what the reference
    payloads of a by-handle variant carry (the digest is of the rows, as written)."""
    out = {}
    for record, arrays in rollouts:
        experts = np.ascontiguousarray(arrays[EXPERTS])
        out[record.rollout_id] = [
            PayloadSegment(
                field=EXPERTS,
                file=str(rollout_rows_path(rows.root, rows.run_id, record.rollout_id)),
                offset=0,
                pos=0,
                rows=len(experts),
                dtype=experts.dtype.name,
                shape=tuple(int(d) for d in experts.shape[1:]),
                digest=payload_checksum(experts),
            )
        ]
    return out


def routed_experts_as(kind: str, rows: RunRows) -> Callable[[list[Rollout]], list[Rollout]]:
    """What a variant's producer does to rollouts read with their routed experts inline
    before it hands them over: nothing (inline), or write them to rows files (handle)."""
    if kind == "handle":
        return lambda rollouts: by_handle(rollouts, rows)
    return lambda rollouts: rollouts


class StepCache:
    """The moe workload's steps as the bench made them, in files under `root`: per step the
    rollouts' records, token arrays and fates (pickled: these files are the bench's own)
    and their routed experts (raw rows, rollout after rollout, one file)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _paths(self, step: int) -> tuple[Path, Path]:
        return self.root / f"step_{step}.pickle", self.root / f"step_{step}.experts"

    def write(self, batch: Any) -> int:
        """Keep a `StepBatch` whose rollouts hold routed experts; returns their bytes."""
        self.root.mkdir(parents=True, exist_ok=True)
        rest, rows = self._paths(batch.step)
        written = 0
        with open(rows, "wb") as out:
            for _, arrays in batch.rollouts:
                experts = np.ascontiguousarray(arrays[EXPERTS], dtype=np.uint8)
                out.write(experts)
                written += experts.nbytes
        dense = [(record, without_experts(arrays)) for record, arrays in batch.rollouts]
        with open(rest, "wb") as out:
            pickle.dump(dataclasses.replace(batch, rollouts=dense), out, protocol=pickle.HIGHEST_PROTOCOL)
        return written

    def read(self, step: int, experts: bool, in_memory: bool = False) -> Any:
        """Step `step`'s `StepBatch`; with `experts`, each rollout's routed experts as a view
        of the step's rows: read into this process's memory (`in_memory`, as an orchestrator
        that holds them), or mapped from the file (a producer handing them on)."""
        rest, path = self._paths(step)
        with open(rest, "rb") as file:
            batch = pickle.load(file)  # written by this bench (`write`)
        if not experts:
            return batch
        if in_memory:
            rows = np.fromfile(path, dtype=np.uint8)
        else:
            with open(path, "rb") as file:
                rows = np.frombuffer(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
        offset = 0
        for _, arrays in batch.rollouts:
            tokens = len(arrays["input_ids"])
            size = tokens * ROW_BYTES
            arrays[EXPERTS] = rows[offset : offset + size].reshape(tokens, MOE_LAYERS, MOE_TOPK)
            offset += size
        return batch

    def batches(self, steps: int, experts: bool, in_memory: bool = False) -> Iterator[Any]:
        """Steps 0 to `steps` - 1, each read when it is asked for (`read`)."""
        return (self.read(step, experts, in_memory) for step in range(steps))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
