"""Release: after a step is published its keys are deleted (one call on the store) and the
worker hands freed heap pages back to the OS, so long runs do not creep in RSS."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return getattr(libc, "malloc_trim", None)


def trim_process_memory() -> bool:
    """`malloc_trim(0)` where glibc has it; returns whether it ran."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
