"""Memory outside the orchestrator process for `rlship bench loop`: Redis's used memory, and
the bytes of files under the directories a run keeps payloads in.

`RedisMemory` reads `INFO memory` from a thread of the bench process every `interval`
seconds (`used_memory`, with the time) and, at both ends, `used_memory_peak`. Redis keeps
that peak for the server's whole life (`CONFIG RESETSTAT` does not reset it: redis/redis
issue 369) and raises it as soon as memory grows (a SET and DEL in one transaction show
in it), so on a server started for the run (`--redis-server own`) it is the run's exact
peak; on a shared server the peak is the sampled maximum, as fine as `interval`.

`MemoryWatch` stops a placement whose processes would take the machine's last memory
(inline routed experts at four times the seed's scale hold several steps of gigabytes in
Redis, the workers and the trainer ranks at once): the bench goes on with the next one.

`DirectoryBytes` follows the files under directories through inotify (created, written,
linked, renamed, deleted; subdirectories as they appear) and keeps their apparent sizes (a
file linked under two names counts once) and each directory's peak. A file's size is read
when its event is taken from the queue, a few milliseconds after it happened unless the
bench process is starved: a file deleted before then is missed (in a run, rows and payload
files live for a step or more). Should the kernel's event queue overflow, the directories
are scanned again and the overflow counted.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import redis

from transport.connection import connect_redis

MEMORY_SAMPLE_SECONDS = 0.02
TIMELINE_POINTS = 1500  # the sampled used memory kept for the JSON and the plot, as bucket maxima
DIRECTORY_TIMELINE_SECONDS = 0.1

# inotify(7)
IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x8, 0x40, 0x80, 0x100, 0x200
IN_Q_OVERFLOW, IN_ISDIR = 0x4000, 0x40000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
WATCHED = IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_EVENT = struct.Struct("iIII")


class RedisMemory:
    """Redis's used memory over a run, from a sampler thread (module docstring)."""

    def __init__(self, redis_url: str, own_server: bool, interval: float = MEMORY_SAMPLE_SECONDS) -> None:
        self.client = connect_redis(redis_url)
        self.own_server = own_server
        self.interval = interval
        self.times: list[float] = []
        self.used: list[int] = []
        self._first: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-memory", daemon=True)

    def start(self) -> RedisMemory:
        self._first = self.client.info("memory")
        self._sample()
        self._thread.start()
        return self

    def _sample(self) -> None:
        used = int(self.client.info("memory")["used_memory"])
        self.times.append(time.monotonic())
        self.used.append(used)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # a sample lost to a failover is a gap, not an error
                self._sample()

    def stop(self) -> dict[str, Any]:
        """The figures: the baseline (used memory when started), the peak and its source,
        the sampled maximum, and how finely it was sampled."""
        self._stop.set()
        self._thread.join(10)
        try:
            last = self.client.info("memory")
        except redis.RedisError:  # the server was stopped (`MemoryWatch`): the samples are all there is
            last = {"used_memory_peak": 0, "used_memory": self.used[-1]}
        self.client.close()
        baseline = int(self._first["used_memory"])
        sampled = max(self.used)
        lifetime = int(last["used_memory_peak"])
        raised = lifetime > int(self._first["used_memory_peak"])
        own = self.own_server and lifetime > 0
        peak, source = (lifetime, "used_memory_peak") if own else (sampled, "sampled")
        gaps = np.diff(self.times) if len(self.times) > 1 else np.zeros(1)
        return {
            "server": "own" if self.own_server else "shared",
            "baseline_bytes": baseline,
            "peak_bytes": peak,
            "peak_growth_bytes": peak - baseline,
            "peak_source": source,
            "sampled_max_bytes": sampled,
            # On a shared server, Redis's own peak when the run raised it (another client's
            # keys may have been part of it); None when the run stayed under the old peak.
            "lifetime_peak_raised_to": lifetime if raised and not self.own_server else None,
            "end_bytes": int(last["used_memory"]),
            "samples": len(self.used),
            "interval_seconds": self.interval,
            "max_gap_seconds": float(gaps.max()),
        }

    def timeline(self, origin: float) -> dict[str, list[float]]:
        """The sampled used memory (MiB) over time since `origin` (monotonic), as the maxima
        of at most TIMELINE_POINTS buckets."""
        t, used = np.asarray(self.times) - origin, np.asarray(self.used, dtype=np.float64)
        if len(t) > TIMELINE_POINTS:
            edges = np.linspace(0, len(t), TIMELINE_POINTS + 1).astype(int)
            t = t[edges[:-1]]
            used = np.maximum.reduceat(used, edges[:-1])
        return {"t": [round(x, 3) for x in t.tolist()], "mib": [round(x / 2**20, 2) for x in used.tolist()]}


class MemoryLimitReached(RuntimeError):
    """A placement stopped by `MemoryWatch`: the machine was running out of memory."""


class MemoryWatch:
    """Stops a placement before it takes the machine's last memory: every `interval` seconds
    it reads the memory available (/proc/meminfo through psutil) and, below `floor_bytes`,
    kills the placement's processes (`victims`: the ones the bench started, its Redis
    server among them when it has its own) and says why (`tripped`)."""

    def __init__(
        self, floor_bytes: int, victims: Callable[[], list[subprocess.Popen]], interval: float = 0.1
    ) -> None:
        self.floor = floor_bytes
        self.victims = victims
        self.interval = interval
        self.tripped: str | None = None
        self.lowest = psutil.virtual_memory().available
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def start(self) -> MemoryWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            available = psutil.virtual_memory().available
            self.lowest = min(self.lowest, available)
            if available < self.floor:
                used = psutil.virtual_memory().total - available
                self.tripped = (
                    f"stopped with {available / 2**30:.1f} GiB of memory available, under the floor of "
                    f"{self.floor / 2**30:.1f} GiB (--min-available-mib; {used / 2**30:.1f} GiB in use)"
                )
                for process in self.victims():
                    with contextlib.suppress(OSError):
                        process.kill()
                return


class DirectoryBytes:
    """The bytes of the files under named directories, followed through inotify, with the
    peak of each and of all together (module docstring). Linux only.

    A named directory need not exist yet (a run makes its own when it first writes there):
    its parent is made if missing and watched with everything under it, and only files
    under the named directory count."""

    def __init__(self, directories: Mapping[str, Path]) -> None:
        self.directories = {name: Path(path) for name, path in directories.items()}
        self.bytes = dict.fromkeys(self.directories, 0)
        self.peaks = dict.fromkeys(self.directories, 0)
        self.peak_total = 0
        self.events = 0
        self.overflows = 0
        self.times: list[float] = []  # the bytes of all the directories, every TIMELINE_SECONDS or so
        self.totals: list[int] = []
        self._prefixes = [(str(path) + os.sep, name) for name, path in self.directories.items()]
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = -1
        self._watches: dict[int, Path] = {}
        self._files: dict[Path, tuple[str, int]] = {}  # path -> (directory name, inode)
        self._inodes: dict[tuple[str, int], list[int]] = {}  # -> [size, names]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="directory-bytes", daemon=True)

    def start(self) -> DirectoryBytes:
        self._fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for path in self.directories.values():
            path.parent.mkdir(parents=True, exist_ok=True)
        self._watch_all()
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(10)
        os.close(self._fd)
        return {
            "peak_bytes": dict(self.peaks),
            "peak_total_bytes": self.peak_total,
            "end_bytes": dict(self.bytes),
            "events": self.events,
            "overflows": self.overflows,
        }

    def _watch_all(self) -> None:
        for parent in {path.parent for path in self.directories.values()}:
            self._watch_tree(parent)

    def _watch_tree(self, top: Path) -> None:
        """Watch `top` and every directory under it, and count the files already there: each
        directory is watched before it is listed, so what is made in it is either listed or
        reported (both is no harm: counting a file again changes nothing)."""
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(top), WATCHED)
        if wd < 0:
            return  # gone already
        self._watches[wd] = top
        try:
            entries = list(os.scandir(top))
        except OSError:
            return
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                self._watch_tree(Path(entry.path))
            else:
                self._stat(Path(entry.path))

    def _name_of(self, path: Path) -> str | None:
        text = str(path)
        return next((name for prefix, name in self._prefixes if text.startswith(prefix)), None)

    def _run(self) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select([self._fd], [], [], DIRECTORY_TIMELINE_SECONDS)
            if readable:
                self._read()
            now = time.monotonic()
            if not self.times or now - self.times[-1] >= DIRECTORY_TIMELINE_SECONDS:
                self.times.append(now)
                self.totals.append(sum(self.bytes.values()))
        self._read()

    def timeline(self, origin: float) -> dict[str, list[float]]:
        """The bytes of all the directories (MiB) over time since `origin` (monotonic), as
        they stood every DIRECTORY_TIMELINE_SECONDS or so (the peak is exact, this is not)."""
        return {
            "t": [round(t - origin, 3) for t in self.times],
            "mib": [round(total / 2**20, 2) for total in self.totals],
        }

    def _read(self) -> None:
        while True:
            try:
                buffer = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            offset = 0
            while offset < len(buffer):
                wd, mask, _cookie, length = _EVENT.unpack_from(buffer, offset)
                raw = buffer[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
                offset += _EVENT.size + length
                self.events += 1
                self._event(wd, mask, os.fsdecode(raw))

    def _event(self, wd: int, mask: int, filename: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self.overflows += 1
            self._rescan()
            return
        if wd not in self._watches or not filename:
            return
        path = self._watches[wd] / filename
        if mask & IN_ISDIR:
            if mask & (IN_CREATE | IN_MOVED_TO):
                self._watch_tree(path)
        elif mask & (IN_DELETE | IN_MOVED_FROM):
            self._forget(path)
        else:
            self._stat(path)

    def _stat(self, path: Path) -> None:
        name = self._name_of(path)
        if name is None:
            return
        try:
            st = os.stat(path)
        except OSError:
            return  # gone already: its deletion is in the queue
        known = self._files.get(path)
        if known is not None and known[1] != st.st_ino:
            self._forget(path)
            known = None
        entry = self._inodes.get((name, st.st_ino))
        if entry is None:
            entry = self._inodes[(name, st.st_ino)] = [0, 0]
        if known is None:
            self._files[path] = (name, st.st_ino)
            entry[1] += 1
        self._add(name, st.st_size - entry[0])
        entry[0] = st.st_size

    def _forget(self, path: Path) -> None:
        known = self._files.pop(path, None)
        if known is None:
            return
        entry = self._inodes[known]
        entry[1] -= 1
        if entry[1] == 0:
            self._add(known[0], -entry[0])
            del self._inodes[known]

    def _add(self, name: str, delta: int) -> None:
        self.bytes[name] += delta
        if delta > 0:
            self.peaks[name] = max(self.peaks[name], self.bytes[name])
            self.peak_total = max(self.peak_total, sum(self.bytes.values()))

    def _rescan(self) -> None:
        """After an overflow: every file counted afresh, every directory watched (again)."""
        self._files.clear()
        self._inodes.clear()
        self.bytes = dict.fromkeys(self.directories, 0)
        self._watch_all()
