"""The run's files on disk: who may read and write them, and a write that fails for space.

Everything a run writes (its output directory, payload root, rows files, payload directory,
rank files, samples, metrics.jsonl, logs) is created under the process umask `FILE_MODES`
sets from the run's `file_mode`: owner-only (0700 directories, 0600 files) by default, or
readable by the group (0750, 0640). The umask, not a mode at each call, so that no file a
run makes is left out; a worker serving several runs takes each task's from its manifest.

Files rlship reads from a shared directory (rows files, rank files) are refused when another
user could have written them (`foreign_write_problem`): rlship would otherwise ship whatever
that user put there.

A write that fails for space (ENOSPC, EDQUOT) raises `DiskFull` naming the path and the bytes
it needed (`space_for`): the run stops in one line instead of retrying into a full disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from typing import Literal

FileMode = Literal["owner", "group"]
# The umask of each mode: what a created directory (0777) and file (0666) lose.
FILE_MODES: dict[str, int] = {"owner": 0o077, "group": 0o027}
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def restrict(file_mode: str) -> None:
    """Create every later file and directory of this process with the run's mode."""
    os.umask(FILE_MODES[file_mode])


class DiskFull(OSError):
    """A write the run needs failed for space: the run stops, naming the path and the bytes."""

    def __init__(self, path: str | os.PathLike[str], needed: int, cause: OSError) -> None:
        super().__init__(
            cause.errno,
            f"no space to write {os.fspath(path)} ({needed:,} bytes needed: {cause.strerror}): "
            "free space there, then resume the run",
        )

    def __str__(self) -> str:
        return str(self.strerror)


@contextlib.contextmanager
def space_for(path: str | os.PathLike[str], needed: int) -> Iterator[None]:
    """A write of `needed` bytes to `path`: a failure for space is `DiskFull`, others as they are."""
    try:
        yield
    except OSError as exc:
        if exc.errno in NO_SPACE and not isinstance(exc, DiskFull):
            raise DiskFull(path, needed, exc) from None
        raise


class RefusedFile(PermissionError):
    """A file rlship was to read that another user could have written."""


def foreign_write_problem(path: str | os.PathLike[str], st: os.stat_result, file_mode: str) -> str | None:
    """Why a file another user could have written is refused, or None: group- or
    world-writable, or another user's (with `file_mode` group, a user of one of this
    process's groups may own it)."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "world" if mode & stat.S_IWOTH else "group"
        return f"{os.fspath(path)} is {who}-writable (mode {mode:04o}): refused"
    ours = st.st_uid == os.geteuid() or (
        file_mode == "group" and st.st_gid in {os.getegid(), *os.getgroups()}
    )
    if not ours:
        return f"{os.fspath(path)} is owned by uid {st.st_uid}, not this process's {os.geteuid()}: refused"
    return None
