"""The claim-check store: rollout arrays and per-rank step payloads in Redis.

Messages (stream records, Celery tasks) carry keys; the bytes live here. Arrays are kept
in a compact binary blob (a MessagePack map of name -> [dtype, shape, raw bytes]) that
decodes into zero-copy numpy views. Every write carries a TTL as a safety net; the ship
path deletes a step's keys explicitly when the step is released. A rollout's payload is
written once (SET NX): a second write of the same id is refused and counted, so a duplicate
can never replace the arrays an earlier record points at. Every key a step owns is
registered in the step's key set, so releasing the step is one call. The per-rank payloads
are the exception: they are retained until every rank has acknowledged the step (or a
bound on retained steps evicts them), so a rank that lost a message can replay it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgpack
import numpy as np
import redis
import redis.asyncio as aioredis

from transport.arrays_blob import PayloadCorruptError, unpack_arrays
from transport.keys import DEFAULT_TTL_SECONDS, WIRE_SUFFIX, RunKeys
from transport.payload_dir import PayloadDirectory, PayloadFileError, is_pointer, read_pointed
from transport.payload_segments import RunRows
from transport.release_scripts import (
    ReleasedPayloads,
    held_rollout_ids,
    release_retained_payloads,
    release_rollouts,
    unlink_step_keys,
)


class PayloadMissingError(KeyError):
    """A claim-check key that is not (or no longer) in Redis."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"payload key {self.key!r} is missing from Redis (never written, expired or released)"


def _decode_rollouts(keys: list[str], values: list[bytes | None]) -> dict[str, dict[str, np.ndarray]]:
    found = _check_found(keys, values)
    return {key.rsplit(":", 1)[1]: unpack_arrays(v, key) for key, v in zip(keys, found, strict=True)}


def _decode_rollouts_leniently(
    keys: list[str], values: list[bytes | None]
) -> dict[str, dict[str, np.ndarray] | PayloadMissingError | PayloadCorruptError]:
    out: dict[str, dict[str, np.ndarray] | PayloadMissingError | PayloadCorruptError] = {}
    for key, value in zip(keys, values, strict=True):
        rollout_id = key.rsplit(":", 1)[1]
        try:
            out[rollout_id] = unpack_arrays(_check_found([key], [value])[0], key)
        except (PayloadMissingError, PayloadCorruptError) as exc:
            out[rollout_id] = exc
    return out


def _check_found(keys: list[str], values: list[bytes | None]) -> list[bytes]:
    for key, value in zip(keys, values, strict=True):
        if value is None:
            raise PayloadMissingError(key)
    return values  # type: ignore[return-value]


class PayloadStore:
    """Synchronous store, used by Celery workers and trainer ranks."""

    def __init__(self, client: redis.Redis, run_id: str, ttl_seconds: int = DEFAULT_TTL_SECONDS):
        self.client = client
        self.keys = RunKeys(run_id)
        self.ttl = ttl_seconds

    def get_rollouts(self, rollout_ids: Iterable[str]) -> dict[str, dict[str, np.ndarray]]:
        """Fetch several rollouts in one round trip; a missing one raises PayloadMissingError."""
        keys = [self.keys.rollout(r) for r in rollout_ids]
        return _decode_rollouts(keys, self.client.mget(keys) if keys else [])

    def fetch_rollouts(
        self, rollout_ids: Iterable[str]
    ) -> dict[str, dict[str, np.ndarray] | PayloadMissingError | PayloadCorruptError]:
        """Like `get_rollouts`, but a missing or corrupt rollout maps to its error instead of
        failing the whole read: one bad rollout must not cost the step."""
        keys = [self.keys.rollout(r) for r in rollout_ids]
        return _decode_rollouts_leniently(keys, self.client.mget(keys) if keys else [])

    def stored_sizes(self, rollout_ids: Iterable[str]) -> dict[str, int]:
        """Each rollout's stored blob size in bytes, 0 if it is gone, without reading any
        (one pipeline of STRLEN)."""
        ids = list(rollout_ids)
        pipe = self.client.pipeline(transaction=False)
        for rollout_id in ids:
            pipe.strlen(self.keys.rollout(rollout_id))
        return dict(zip(ids, pipe.execute() if ids else [], strict=True))

    def get_sample_wires(self, rollout_ids: Iterable[str]) -> dict[str, bytes]:
        """The prepared wire parts of those rollouts that have them (one MGET)."""
        ids = list(rollout_ids)
        values = self.client.mget([self.keys.sample_wire(r) for r in ids]) if ids else []
        return {rollout_id: value for rollout_id, value in zip(ids, values, strict=True) if value is not None}

    def put_sample_wires(self, wires: Mapping[str, bytes]) -> int:
        """Store prepared wire parts, each only while its rollout is stored: one whose rollout
        was discarded meanwhile (stale at a cut, its run ended) is not written, so none is
        left behind. Returns how many were written."""
        if not wires:
            return 0
        keys = [key for r in wires for key in self.keys.rollout_keys(r)]
        return int(
            self.client.register_script(_PUT_SAMPLE_WIRES_LUA)(keys=keys, args=[self.ttl, *wires.values()])
        )

    def release_sample_wires(self, rollout_ids: Iterable[str]) -> None:
        """Unlink those rollouts' wire parts (their rank's payload is written)."""
        keys = [self.keys.sample_wire(r) for r in rollout_ids]
        if keys:
            self.client.unlink(*keys)

    def put_step_value(self, step: int, name: str, value: bytes | memoryview) -> str:
        """Write a step-scoped value and register it with the step; returns its key."""
        key = self.keys.step(step, name)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(key, value, ex=self.ttl)
        pipe.sadd(self.keys.step_keys(step), key)
        pipe.expire(self.keys.step_keys(step), self.ttl)
        pipe.execute()
        return key

    def get_step_value(self, step: int, name: str) -> bytes:
        return self._get(self.keys.step(step, name))

    def _get(self, key: str) -> bytes:
        return _check_found([key], [self.client.get(key)])[0]

    def put_payload(
        self,
        step: int,
        rank: int,
        payload: bytes | memoryview,
        directory: PayloadDirectory | None = None,
        checksum: str = "",
        rows_bytes: int = 0,
    ) -> str:
        """Write one rank's encoded step, retained past the step's release (module docstring):
        its bytes, or with a `directory` a pointer to the file they are written to (with
        their `checksum`, which reads check). Its bytes and those of the rows files it points
        at (`rows_bytes`) count against the run's budget until it is released."""
        key = self.keys.payload(step, rank)
        value = payload if directory is None else directory.write(step, rank, payload, checksum)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(key, value, ex=self.ttl)
        held = memoryview(payload).nbytes + rows_bytes
        hold = self.client.register_script(_HOLD_LUA)
        hold(
            keys=[self.keys.held_bytes, self.keys.held_bytes_total],
            args=[payload_holder(step, rank), held, self.ttl],
            client=pipe,
        )
        pipe.zadd(self.keys.retained_payloads, {str(step): step})
        pipe.expire(self.keys.retained_payloads, self.ttl)
        pipe.execute()
        return key

    def get_payload(self, step: int, rank: int) -> bytes:
        """A rank's retained payload, read through its pointer if it is kept in a directory."""
        key = self.keys.payload(step, rank)
        value = self._get(key)
        if not is_pointer(value):
            return value
        try:
            return read_pointed(value)
        except PayloadFileError as exc:
            raise PayloadCorruptError(f"{key}: {exc}") from exc

    def release_payloads(
        self,
        ranks: int,
        through_step: int,
        evict_through: int,
        rows: RunRows | None = None,
        directory: PayloadDirectory | None = None,
    ) -> ReleasedPayloads:
        """Release the retained payloads of steps <= `through_step` that every rank has
        acknowledged, and of steps <= `evict_through` whether acknowledged or not; with them
        their files in `directory` and the files of side-array rows they point at
        (`hold_rows`)."""
        released = ReleasedPayloads.from_script(
            release_retained_payloads(self.client, self.keys, ranks, through_step, evict_through)
        )
        if directory is not None:
            directory.remove_steps(released.released)
        if rows is not None and released.released:
            held = [self.keys.rows_held(step) for step in released.released]
            rows.unlink(
                rollout_id for value in self.client.mget(held) for rollout_id in held_rollout_ids(value)
            )
            self.client.unlink(*held)
        return released

    def hold_rows(self, step: int, rollout_ids: list[str]) -> None:
        """The rollouts whose rows files stay with the step's retained payloads."""
        if rollout_ids:
            self.client.set(self.keys.rows_held(step), msgpack.packb(rollout_ids), ex=self.ttl)

    def delete_step(self, step: int) -> int:
        """Unlink every key registered with the step (and the registry); returns how many."""
        return int(unlink_step_keys(self.client, self.keys, step))

    def held_keys(self) -> list[str]:
        """The run's keys that releasing must remove: rollout payloads, step keys, retained
        payloads and acknowledgement sets. Empty after a run that released everything."""
        return sorted(
            key.decode()
            for pattern in self.keys.held_patterns
            for key in self.client.scan_iter(match=pattern, count=1000)
        )

    def stop_run(self, problem: str) -> None:
        """The run cannot go on (it cannot ship, a disk it writes is full): say why where its
        orchestrator looks every second (`RunKeys.ship_fatal`); it stops the run naming it."""
        self.client.set(self.keys.ship_fatal, problem, ex=DEFAULT_TTL_SECONDS)

    def expire_run(self, seconds: int = DEFAULT_TTL_SECONDS) -> None:
        """Every key of the run lives at least half of `seconds` from now (`seconds` if it
        had no expiry or less than that): at a run's end, and renewed while it lives
        (`orchestrator.lease`), so that no key of a run lives forever, nor expires under a
        run that lives (or pauses) for less than that. Keys with short expiries of their own
        (`RunKeys.self_expiring`) are left to them."""
        keys = list(self.client.scan_iter(match=self.keys.prefix + "*", count=1000))
        pipe = self.client.pipeline(transaction=False)
        _renew(pipe, self.keys, keys, seconds)
        pipe.execute()

    def delete_all_rollouts(self) -> int:
        """Release every rollout of the run (`release_rollouts`: its keys, and its bytes out of
        the budget): at teardown, whatever is left never ships."""
        found = self.client.scan_iter(match=self.keys.rollout("*"), count=1000)
        ids = _rollout_ids(self.keys, found)
        return sum(int(release_rollouts(self.client, self.keys, batch)) for batch in _batches(ids))


class AsyncPayloadStore:
    """The same store on `redis.asyncio`, for the orchestrator and async producers. It moves
    only small values on the loop; rollout arrays are written by producers."""

    def __init__(self, client: aioredis.Redis, run_id: str, ttl_seconds: int = DEFAULT_TTL_SECONDS):
        self.client = client
        self.keys = RunKeys(run_id)
        self.ttl = ttl_seconds

    async def delete_rollouts(self, rollout_ids: Iterable[str]) -> int:
        """Release rollouts that will never ship (UNLINK frees them off Redis's main thread)."""
        ids = list(rollout_ids)
        return int(await release_rollouts(self.client, self.keys, ids)) if ids else 0

    async def release_payloads(
        self,
        ranks: int,
        through_step: int,
        evict_through: int,
        rows: RunRows | None = None,
        directory: PayloadDirectory | None = None,
    ) -> ReleasedPayloads:
        """See `PayloadStore.release_payloads` (the files are deleted off the event loop)."""
        released = ReleasedPayloads.from_script(
            await release_retained_payloads(self.client, self.keys, ranks, through_step, evict_through)
        )
        if directory is not None and released.released:
            await asyncio.to_thread(directory.remove_steps, released.released)
        if rows is not None and released.released:
            held = [self.keys.rows_held(step) for step in released.released]
            ids = [
                rollout_id for value in await self.client.mget(held) for rollout_id in held_rollout_ids(value)
            ]
            await asyncio.to_thread(rows.unlink, ids)
            await self.client.unlink(*held)
        return released

    async def unacknowledged_steps(self) -> list[int]:
        """Steps whose payloads are still retained (some rank has not acknowledged them)."""
        return [int(s) for s in await self.client.zrange(self.keys.retained_payloads, 0, -1)]

    async def expire_run(self, seconds: int = DEFAULT_TTL_SECONDS) -> None:
        """See `PayloadStore.expire_run`."""
        keys = [key async for key in self.client.scan_iter(match=self.keys.prefix + "*", count=1000)]
        pipe = self.client.pipeline(transaction=False)
        _renew(pipe, self.keys, keys, seconds)
        await pipe.execute()

    async def delete_all_rollouts(self) -> int:
        """Release every rollout of the run (see `PayloadStore.delete_all_rollouts`)."""
        found = [key async for key in self.client.scan_iter(match=self.keys.rollout("*"), count=1000)]
        ids = _rollout_ids(self.keys, found)
        return sum([int(await release_rollouts(self.client, self.keys, batch)) for batch in _batches(ids)])


def _rollout_ids(keys: RunKeys, found: Iterable[bytes]) -> list[str]:
    """The rollout ids of rollout keys (`RunKeys.rollout_keys`: arrays and wire parts)."""
    prefix = keys.rollout("")
    return sorted({key.decode().removeprefix(prefix).removesuffix(WIRE_SUFFIX) for key in found})


def _batches(ids: list[str], size: int = 500) -> Iterator[list[str]]:
    for start in range(0, len(ids), size):
        yield ids[start : start + size]


# KEYS: per rollout, its arrays' key and its wire key; ARGV: the TTL, then the wires.
_PUT_SAMPLE_WIRES_LUA = """
local written = 0
for i = 1, #KEYS, 2 do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('SET', KEYS[i + 1], ARGV[(i + 1) / 2 + 1], 'EX', ARGV[1])
    written = written + 1
  end
end
return written
"""

# KEYS: the held hash and total; ARGV: the holder, its bytes, the TTL. A redelivered encode
# holds its payload's bytes once.
_HOLD_LUA = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('INCRBY', KEYS[2], ARGV[2])
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
"""


# KEYS: keys of the run; ARGV: the seconds. A key without an expiry, or expiring within half
# of them, gets them; any other is not touched: an EXPIRE that applies counts as a write, and
# would abort a stage's transaction that WATCHes the key (finalize watches the manifest the
# cut has just written).
_RENEW_LUA = """
local renewed = 0
for _, key in ipairs(KEYS) do
  local ttl = redis.call('TTL', key)
  if ttl == -1 or (ttl >= 0 and ttl * 2 < tonumber(ARGV[1])) then
    redis.call('EXPIRE', key, ARGV[1])
    renewed = renewed + 1
  end
end
return renewed
"""


def _renew(pipe: Any, keys: RunKeys, found: list[bytes], seconds: int) -> None:
    """Queue on `pipe` the expiry `expire_run` gives each key found and the run's own queues'
    (`RunKeys.own_queue_traces`): `seconds` for a key without one or expiring within half of
    them (`_RENEW_LUA`)."""
    skipped = keys.self_expiring
    names = [k for k in [*found, *(n.encode() for n in keys.own_queue_traces)] if k.decode() not in skipped]
    for start in range(0, len(names), 500):
        batch = names[start : start + 500]
        pipe.eval(_RENEW_LUA, len(batch), *batch, seconds)


def payload_holder(step: int, rank: int) -> str:
    """A retained payload's field in `RunKeys.held_bytes`."""
    return f"payload:{step}:{rank}"
