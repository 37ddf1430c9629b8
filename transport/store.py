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
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import redis
import redis.asyncio as aioredis

from transport.keys import PAYLOAD, WIRE_SUFFIX, RunKeys
from transport.payload_dir import PayloadDirectory, PayloadFileError, is_pointer, read_pointed
from transport.payload_segments import PAYLOAD_FIELD, PayloadSegment, RunRows
from transport.schema import MM_KWARGS_PREFIX, EncodedTensor, SchemaError, as_encoded_tensors, as_segments

DEFAULT_TTL_SECONDS = 24 * 3600


class PayloadMissingError(KeyError):
    """A claim-check key that is not (or no longer) in Redis."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"payload key {self.key!r} is missing from Redis (never written, expired or released)"


class PayloadCorruptError(ValueError):
    """A stored value that does not decode as an array blob."""


def flat_arrays(arrays: Mapping[str, Any]) -> dict[str, Any]:
    """A rollout's arrays with its `mm_kwargs` (a map of name -> tensor: an EncodedTensor or
    a numpy array) stored flat, as `mm_kwargs.{name}` -> EncodedTensor, and its side arrays
    by handle (`payload`) as a list of `PayloadSegment`. SchemaError names a malformed
    tensor or segment."""
    out: dict[str, Any] = {}
    for name, value in arrays.items():
        if name == PAYLOAD_FIELD:
            out[name] = as_segments(value)
        elif name == "mm_kwargs":
            if not isinstance(value, Mapping):
                raise SchemaError(f"mm_kwargs: expected a map of name to tensor, got {type(value).__name__}")
            tensors = as_encoded_tensors(dict(value))
            out.update({MM_KWARGS_PREFIX + kwarg: tensor for kwarg, tensor in tensors.items()})
        elif name.startswith(MM_KWARGS_PREFIX):
            out[name] = as_encoded_tensors({name[len(MM_KWARGS_PREFIX) :]: value}).popitem()[1]
        else:
            out[name] = value
    return out


# How a rollout's segments are held in its blob, beside its arrays' [dtype, shape, data].
_SEGMENTS_DTYPE = "segments"


def pack_arrays(arrays: Mapping[str, Any]) -> bytes:
    """Arrays to one compact blob: no JSON lists, one copy of each array's bytes. An
    mm_kwargs tensor keeps the producer's dtype name (it may be one numpy lacks)."""
    entries: dict[str, list[Any]] = {}
    for name, value in flat_arrays(arrays).items():
        if name == PAYLOAD_FIELD:
            stored = msgpack.packb([segment.to_stored() for segment in value], use_bin_type=True)
            entries[name] = [_SEGMENTS_DTYPE, [len(value)], stored]
            continue
        if isinstance(value, EncodedTensor):
            entries[name] = [value.dtype, list(value.shape), value.data]
            continue
        array = np.ascontiguousarray(value)
        data = memoryview(array).cast("B") if array.size else b""  # no cast of a zero in the shape
        entries[name] = [array.dtype.str, list(array.shape), data]
    return msgpack.packb(entries, use_bin_type=True)


def unpack_arrays(blob: bytes, key: str = "<blob>") -> dict[str, Any]:
    """The inverse of `pack_arrays`: arrays are read-only views into `blob`, mm_kwargs
    tensors EncodedTensor. PayloadCorruptError names the entry that does not decode."""
    try:
        entries = msgpack.unpackb(blob, raw=False)
        if not isinstance(entries, dict):
            raise TypeError(f"expected a map, got {type(entries).__name__}")
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise PayloadCorruptError(f"{key}: stored arrays do not decode ({exc})") from exc
    arrays = {}
    for name, entry in entries.items():
        try:
            arrays[name] = _unpack_entry(name, entry)
        except (ValueError, TypeError, SyntaxError, msgpack.UnpackException) as exc:  # SyntaxError: a dtype
            raise PayloadCorruptError(f"{key}: stored arrays do not decode (entry {name!r}: {exc})") from exc
    return arrays


def _unpack_entry(name: str, entry: Any) -> Any:
    dtype, shape, data = entry
    if name.startswith(MM_KWARGS_PREFIX):
        return EncodedTensor(dtype, shape, data)
    if dtype == _SEGMENTS_DTYPE:
        return [PayloadSegment.from_values(values) for values in msgpack.unpackb(data, raw=False)]
    # reshape would fill in a -1 (or take a bool): a shape says each dimension itself
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"shape {shape!r:.80} is not a list of dimensions >= 0")
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


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
            _release_payloads(self.client, self.keys, ranks, through_step, evict_through)
        )
        if directory is not None:
            directory.remove_steps(released.released)
        if rows is not None and released.released:
            held = [self.keys.rows_held(step) for step in released.released]
            rows.unlink(rollout_id for value in self.client.mget(held) for rollout_id in _held_ids(value))
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
        """Every key of the run lives `seconds` from now, or longer if it already would: at a
        run's end, and renewed while it lives (`orchestrator.lease`), so that no key of a run
        lives forever, nor expires under a run that lives (or pauses) for less than that.
        Keys with short expiries of their own (`RunKeys.self_expiring`) are left to them."""
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
            await _release_payloads(self.client, self.keys, ranks, through_step, evict_through)
        )
        if directory is not None and released.released:
            await asyncio.to_thread(directory.remove_steps, released.released)
        if rows is not None and released.released:
            held = [self.keys.rows_held(step) for step in released.released]
            ids = [rollout_id for value in await self.client.mget(held) for rollout_id in _held_ids(value)]
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

# Taking a holder's bytes out of the run's budget (`RunKeys.held_bytes` and its total), once;
# a rollout's (with `flow`, `RunKeys.rollout_flow`) counted as released, with its bytes.
_UNHOLD_LUA = """
local function unhold(held, total, holder, flow)
  local bytes = redis.call('HGET', held, holder)
  if bytes then
    redis.call('HDEL', held, holder)
    redis.call('DECRBY', total, bytes)
    if flow then
      redis.call('HINCRBY', flow, 'released', 1)
      redis.call('HINCRBY', flow, 'released_bytes', bytes)
      redis.call('EXPIRE', flow, ARGV[#ARGV])
    end
  end
end
"""

# KEYS: the held hash and total, the step's key set, the rollout flow; ARGV: the wire suffix,
# the TTL. A rollout key's wire sibling goes with it (not counted), and its bytes out of the
# budget.
_DELETE_STEP_LUA = (
    _UNHOLD_LUA
    + """
local members = redis.call('SMEMBERS', KEYS[3])
local deleted = 0
for i = 1, #members, 1000 do
  deleted = deleted + redis.call('UNLINK', unpack(members, i, math.min(i + 999, #members)))
end
local wires = {}
for _, key in ipairs(members) do
  local rollout_id = string.match(key, ':rollout:(.*)$')
  if rollout_id then
    table.insert(wires, key .. ARGV[1])
    unhold(KEYS[1], KEYS[2], rollout_id, KEYS[4])
  end
end
for i = 1, #wires, 1000 do
  redis.call('UNLINK', unpack(wires, i, math.min(i + 999, #wires)))
end
redis.call('UNLINK', KEYS[3])
return deleted
"""
)

# KEYS: the held hash and total, the rollout flow, then each rollout's keys
# (`RunKeys.rollout_keys`); ARGV: the rollout ids, then the TTL. Returns how many rollout
# keys were unlinked.
_RELEASE_ROLLOUTS_LUA = (
    _UNHOLD_LUA
    + """
for i = 1, #ARGV - 1 do
  unhold(KEYS[1], KEYS[2], ARGV[i], KEYS[3])
end
local deleted = 0
for i = 4, #KEYS, 1000 do
  deleted = deleted + redis.call('UNLINK', unpack(KEYS, i, math.min(i + 999, #KEYS)))
end
return deleted
"""
)

# KEYS: the held hash and total; ARGV: the holder, its bytes, the TTL. A redelivered encode
# holds its payload's bytes once.
_HOLD_LUA = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('INCRBY', KEYS[2], ARGV[2])
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
"""


def _renew(pipe: Any, keys: RunKeys, found: list[bytes], seconds: int) -> None:
    """Queue on `pipe` the expiry `expire_run` gives each key found and the run's own queues'
    (`RunKeys.own_queue_traces`): `seconds` for a key without one (NX) or expiring sooner (GT)."""
    skipped = keys.self_expiring
    for key in [*found, *(name.encode() for name in keys.own_queue_traces)]:
        if key.decode() not in skipped:
            pipe.expire(key, seconds, nx=True)
            pipe.expire(key, seconds, gt=True)


def payload_holder(step: int, rank: int) -> str:
    """A retained payload's field in `RunKeys.held_bytes`."""
    return f"payload:{step}:{rank}"


def release_rollouts(client: Any, keys: RunKeys, rollout_ids: list[str]) -> Any:
    """Unlink rollouts that will never ship and take their bytes out of the budget, on a sync
    or async client or a pipeline (queued with the rest of it)."""
    rollout_keys = [key for r in rollout_ids for key in keys.rollout_keys(r)]
    return client.register_script(_RELEASE_ROLLOUTS_LUA)(
        keys=[keys.held_bytes, keys.held_bytes_total, keys.rollout_flow, *rollout_keys],
        args=[*rollout_ids, DEFAULT_TTL_SECONDS],
    )


@dataclass(frozen=True)
class ReleasedPayloads:
    """What one release of retained payloads did: the steps it freed, and which of them were
    evicted by the retention bound before every rank acknowledged them."""

    released: list[int]
    evicted_unacknowledged: list[int]

    @property
    def steps(self) -> int:
        return len(self.released)

    @classmethod
    def from_script(cls, reply: list[Any]) -> ReleasedPayloads:
        return cls(sorted(int(s) for s in reply[0]), sorted(int(s) for s in reply[1]))


# KEYS[1]: the retained-steps set, KEYS[2] and [3] the held hash and total (`_UNHOLD_LUA`).
# ARGV: the step-key prefix ("...:step:"), the trained-set prefix ("...:trained:"), ranks,
# the newest step to consider, the newest step to evict even if unacknowledged, the payload
# name (`step:{n}:{name}:{rank}`). A released step also loses its `trained` set, and its
# payloads' bytes leave the budget.
_RELEASE_PAYLOADS_LUA = (
    _UNHOLD_LUA
    + """
local ranks = tonumber(ARGV[3])
local evict_through = tonumber(ARGV[5])
local released, evicted = {}, {}
for _, step in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[4])) do
  local acked = redis.call('SCARD', ARGV[2] .. step)
  if acked >= ranks or tonumber(step) <= evict_through then
    for rank = 0, ranks - 1 do
      redis.call('UNLINK', ARGV[1] .. step .. ':' .. ARGV[6] .. ':' .. rank)
      unhold(KEYS[2], KEYS[3], 'payload:' .. step .. ':' .. rank)
    end
    redis.call('UNLINK', ARGV[2] .. step)
    if acked < ranks then
      table.insert(evicted, step)
    end
    redis.call('ZREM', KEYS[1], step)
    table.insert(released, step)
  end
end
return {released, evicted}
"""
)


def _held_ids(value: bytes | None) -> list[str]:
    return msgpack.unpackb(value, raw=False) if value else []


def _release_payloads(client: Any, keys: RunKeys, ranks: int, through_step: int, evict_through: int) -> Any:
    return client.register_script(_RELEASE_PAYLOADS_LUA)(
        keys=[keys.retained_payloads, keys.held_bytes, keys.held_bytes_total],
        args=[keys.steps_prefix, keys.trained_prefix, ranks, through_step, evict_through, PAYLOAD],
    )


def unlink_step_keys(client: Any, keys: RunKeys, step: int) -> Any:
    """Run the release script on a sync or async client or pipeline (async: an awaitable; a
    pipeline: queued, so a transaction can take a step back with the rest of it)."""
    return client.register_script(_DELETE_STEP_LUA)(
        keys=[keys.held_bytes, keys.held_bytes_total, keys.step_keys(step), keys.rollout_flow],
        args=[WIRE_SUFFIX, DEFAULT_TTL_SECONDS],
    )
