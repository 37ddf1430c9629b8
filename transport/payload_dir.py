"""Per-rank payloads kept in a directory instead of Redis (`--payload-store dir`).

A step's payloads with routed experts inline run to gigabytes, and the ship path retains
them for `replay_steps` steps: Redis memory, not the event loop, would be the limit. With
this store each payload is written once to `{root}/step_{n}/rank_{r}.bin` on the storage
the ship worker and the trainer ranks share (under a temporary name, then renamed, so no
reader sees half a file), and its Redis key holds a small pointer instead of the bytes: the
path, the size and the checksum. Whoever reads the key (the send task, a restarted rank's
replay) reads the file through the pointer and checks both, so the marks, the release
script and the replay logic stay the ones the Redis store uses. A step's files are
deleted when its payloads are released, as its keys are.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from transport.checksum import payload_checksum
from transport.run_files import space_for

# A payload's top level is a MessagePack array (0x90-0x9f, 0xdc, 0xdd): it never starts so.
POINTER_PREFIX = b"rlship-payload-file\n"


class PayloadFileError(OSError):
    """A payload file that is gone, or not the size or checksum its pointer says."""


def is_pointer(value: bytes) -> bool:
    return value.startswith(POINTER_PREFIX)


def read_pointed(value: bytes) -> bytes:
    """The payload a pointer names, checked against its size and checksum."""
    pointer = json.loads(value[len(POINTER_PREFIX) :])
    path = Path(pointer["path"])
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PayloadFileError(f"payload file {path}: {exc.strerror}") from exc
    if len(data) != pointer["size"] or payload_checksum(data) != pointer["checksum"]:
        raise PayloadFileError(
            f"payload file {path}: {len(data)} bytes, checksum {payload_checksum(data)}; written as "
            f"{pointer['size']} bytes, checksum {pointer['checksum']}"
        )
    return data


@dataclass(frozen=True)
class PayloadDirectory:
    """A run's directory of retained per-rank payloads."""

    root: Path

    def path(self, step: int, rank: int) -> Path:
        return self.root / f"step_{step}" / f"rank_{rank}.bin"

    def write(self, step: int, rank: int, payload: bytes | memoryview, checksum: str) -> bytes:
        """Write the payload once (a redelivered encode writes the same bytes over it) and
        return the pointer its key holds; `DiskFull` without room for it (nothing is left)."""
        path = self.path(step, rank)
        size = memoryview(payload).nbytes
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with space_for(path, size):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(temporary, "wb") as out:
                    out.write(payload)
                os.replace(temporary, path)
            finally:
                temporary.unlink(missing_ok=True)
        pointer = {"path": str(path.resolve()), "size": size, "checksum": checksum}
        return POINTER_PREFIX + json.dumps(pointer).encode()

    def remove_steps(self, steps: Iterable[int]) -> None:
        for step in steps:
            shutil.rmtree(self.root / f"step_{step}", ignore_errors=True)

    def remove_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def payload_directory(output_dir: Path, run_id: str) -> PayloadDirectory:
    """A run's retained payloads: under its output directory, apart from any other run's."""
    return PayloadDirectory(Path(output_dir) / "step-payloads" / run_id)
