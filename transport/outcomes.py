"""What became of each rollout, for the producer that wrote it (`RolloutProducer.outcome`).

Whoever decides a rollout's fate writes it here, in the same words for every writer: the
orchestrator when it rejects a record or discards a rollout (its group's fate, stale at the
cut), finalize when it cuts a step (`step N` for every rollout of the cut, `dropped N
reason` for those it drops). A rollout cut into a step whose record is published has
shipped in it. The hash keeps the run's newest `horizon` rollouts (the oldest leave first,
through `outcome_order`), so a run of any length holds a bounded history; each outcome is
counted once in `outcome_counts` (a retried task writes the same words again and counts
nothing), which the Prometheus endpoint reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from transport.keys import RunKeys

SHIPPED, CUT, DROPPED, DISCARDED, REJECTED, PENDING, UNKNOWN = (
    "shipped", "cut", "dropped", "discarded", "rejected", "pending", "unknown",
)  # fmt: skip
# Outcomes and counts are written in pieces of this many rollouts (Lua's unpack has a limit).
PIECE = 1000

# KEYS: outcomes, outcome_order, outcome_counts. ARGV: the horizon, the TTL, then per
# rollout its id, its outcome and the count it adds to ('' for none). A rollout whose
# outcome is already these words counts nothing again.
_RECORD_LUA = """
local new = {}
for i = 3, #ARGV, 3 do
  local was = redis.call('HGET', KEYS[1], ARGV[i])
  if was ~= ARGV[i + 1] then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    if not was then new[#new + 1] = ARGV[i] end
    if ARGV[i + 2] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[i + 2], 1) end
  end
end
if #new > 0 then redis.call('RPUSH', KEYS[2], unpack(new)) end
local excess = redis.call('LLEN', KEYS[2]) - tonumber(ARGV[1])
if excess > 0 then
  local gone = redis.call('LPOP', KEYS[2], excess)
  for i = 1, #gone, 1000 do
    redis.call('HDEL', KEYS[1], unpack(gone, i, math.min(i + 999, #gone)))
  end
end
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[2]) end
return #new
"""

# KEYS: outcomes, published, then each rollout's arrays key. ARGV: the rollout ids.
_READ_LUA = """
local out = {}
for i = 1, #ARGV do
  local outcome = redis.call('HGET', KEYS[1], ARGV[i])
  if outcome then
    local step = string.match(outcome, '^step (%d+)$')
    if step and redis.call('HEXISTS', KEYS[2], step) == 1 then outcome = 'shipped ' .. step end
  elseif redis.call('EXISTS', KEYS[i + 2]) == 1 then
    outcome = 'pending'
  else
    outcome = 'unknown'
  end
  out[i] = outcome
end
return out
"""


# An outcome as written: its words, and the counter it adds to ('' for none).
Written = tuple[str, str]


def cut_into(step: int) -> Written:
    return f"step {step}", ""


def dropped_at(step: int, reason: str, field: str) -> Written:
    """Dropped by the workers at the cut of `step`, counted under the offending `field`."""
    return f"dropped {step} {reason}", f"{DROPPED}/{field}"


def discarded(reason: str) -> Written:
    return f"discarded {reason}", f"{DISCARDED}/{reason}"


def rejected(reason: str, message: str) -> Written:
    return f"rejected {reason} {message}", f"{REJECTED}/{reason}"


def record_outcomes(
    client: Any, keys: RunKeys, outcomes: Mapping[str, Written], horizon: int, ttl: int
) -> list[Any]:
    """Write each rollout's outcome (made by `cut_into`, `dropped_at`, `discarded`,
    `rejected`), on a sync or async client or a pipeline (queued with the rest of it).
    Returns the script calls' results (awaitables on an async client)."""
    script = client.register_script(_RECORD_LUA)
    items = list(outcomes.items())
    calls = []
    for start in range(0, len(items), PIECE):
        args: list[Any] = [horizon, ttl]
        for rollout_id, (words, counter) in items[start : start + PIECE]:
            args += [rollout_id, words, counter]
        calls.append(script(keys=[keys.outcomes, keys.outcome_order, keys.outcome_counts], args=args))
    return calls


@dataclass(frozen=True)
class RolloutOutcome:
    """What became of one rollout: `state` is shipped (in `step`), cut (into `step`, not
    yet published), dropped (at the cut of `step`, `reason`), discarded or rejected
    (`reason`), pending (stored, its fate not decided yet: its group is open or it waits
    for a cut) or unknown (never written to this run, or older than the run's horizon)."""

    state: str
    step: int | None = None
    reason: str | None = None

    @classmethod
    def parse(cls, text: str) -> RolloutOutcome:
        kind, _, rest = text.partition(" ")
        if kind == "step":
            return cls(CUT, int(rest))
        if kind == SHIPPED:
            return cls(SHIPPED, int(rest))
        if kind == DROPPED:
            step, _, reason = rest.partition(" ")
            return cls(DROPPED, int(step), reason)
        if kind in (DISCARDED, REJECTED):
            return cls(kind, None, rest)
        return cls(kind)

    def __str__(self) -> str:
        where = f" in step {self.step}" if self.state in (SHIPPED, CUT) else ""
        at = f" at the cut of step {self.step}" if self.state == DROPPED else ""
        why = f": {self.reason}" if self.reason else ""
        return f"{self.state}{where}{at}{why}"


def outcome_call(keys: RunKeys, rollout_ids: Iterable[str]) -> tuple[str, list[str], list[str]]:
    """The read script and its keys and arguments, for `client.eval` on a sync or async client."""
    ids = list(rollout_ids)
    return _READ_LUA, [keys.outcomes, keys.published, *(keys.rollout(r) for r in ids)], ids


def parse_outcomes(rollout_ids: Iterable[str], reply: list[bytes]) -> dict[str, RolloutOutcome]:
    return {r: RolloutOutcome.parse(raw.decode()) for r, raw in zip(rollout_ids, reply, strict=True)}


def outcome_counts(client: Any, keys: RunKeys) -> dict[str, int]:
    """`{kind}/{reason}` to how many rollouts had that outcome (a sync client)."""
    return {k.decode(): int(v) for k, v in client.hgetall(keys.outcome_counts).items()}
