"""Releasing what a run holds in Redis, each in one Lua script: rollouts that will never
ship, a released step's keys, and retained per-rank payloads once every rank acknowledged
them (or the retention bound evicts them). Each takes the bytes it frees out of the run's
byte budget (`RunKeys.held_bytes`) once, and counts released rollouts in the rollout flow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from transport.keys import DEFAULT_TTL_SECONDS, PAYLOAD, WIRE_SUFFIX, RunKeys

# Taking a holder's bytes out of the run's budget (`RunKeys.held_bytes` and its total), once:
# `unhold` returns them (nil if it held none). Rollouts released are counted in the rollout
# flow (`RunKeys.rollout_flow`), with their bytes, once per script (from `tally`).
_UNHOLD_LUA = """
local function unhold(held, total, holder)
  local bytes = redis.call('HGET', held, holder)
  if bytes then
    redis.call('HDEL', held, holder)
    redis.call('DECRBY', total, bytes)
    return tonumber(bytes)
  end
end
local tally = {rollouts = 0, bytes = 0}
local function unhold_rollout(held, total, rollout_id)
  local bytes = unhold(held, total, rollout_id)
  if bytes then
    tally.rollouts = tally.rollouts + 1
    tally.bytes = tally.bytes + bytes
  end
end
local function count_released(flow)
  if tally.rollouts > 0 then
    redis.call('HINCRBY', flow, 'released', tally.rollouts)
    redis.call('HINCRBY', flow, 'released_bytes', tally.bytes)
    redis.call('EXPIRE', flow, ARGV[#ARGV])
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
    unhold_rollout(KEYS[1], KEYS[2], rollout_id)
  end
end
for i = 1, #wires, 1000 do
  redis.call('UNLINK', unpack(wires, i, math.min(i + 999, #wires)))
end
redis.call('UNLINK', KEYS[3])
count_released(KEYS[4])
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
  unhold_rollout(KEYS[1], KEYS[2], ARGV[i])
end
count_released(KEYS[3])
local deleted = 0
for i = 4, #KEYS, 1000 do
  deleted = deleted + redis.call('UNLINK', unpack(KEYS, i, math.min(i + 999, #KEYS)))
end
return deleted
"""
)


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


def held_rollout_ids(value: bytes | None) -> list[str]:
    return msgpack.unpackb(value, raw=False) if value else []


def release_retained_payloads(
    client: Any, keys: RunKeys, ranks: int, through_step: int, evict_through: int
) -> Any:
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
