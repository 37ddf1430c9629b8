"""The producers' one script (orchestrator.producer): a call's rollouts written, admitted
and appended to the rollout stream in one step, so concurrent producers cannot overshoot
the run's bounds."""

from __future__ import annotations

# KEYS: the rollout stream, the produced and accounted counters, the refused-writes counter,
# the run's next step, the held-bytes hash and total, the run's finished mark, the rollout
# flow (bytes produced), then one payload key per rollout. ARGV:
# the TTL, the backlog limit (-1: not admitted), the room the policy gate leaves, the next
# step that room was worked out for (as read, '' if unset), the byte budget (-1: none), the
# batch size, the call's bytes, then per rollout its arrays blob, its record, its
# `PayloadFacts`, its bytes (blob and rows files) and its `GivenCredit` ('' for none: the
# group baseline's). The call is admitted whole or not at
# all, in the same step as the writes, so concurrent producers cannot overshoot: the backlog
# (produced, not yet accounted by the orchestrator: in the stream, in open groups or
# pending) plus this call must fit both bounds, and the bytes the run holds plus the call's
# its byte budget, unless the backlog is short of a batch: the next step's batch can always
# be completed (the run ships it, and releasing it frees bytes; `refuse_oversize` sees that
# one batch fits the budget). A step
# cut since the room was worked out (`moved`) shrinks both the backlog and the room: the
# caller works it out again.
# A payload is written only if its key is new (a claim check is written once), and only then
# is its record appended: a duplicate id can neither replace the original's arrays nor reach
# the orchestrator. The stream and the counters it writes get the payloads' expiry too: a
# producer still writing after its run ended (and its keys were unlinked) leaves nothing
# behind for ever.
# A run that has finished takes nothing.
# Returns the verdict, the backlog, then the 1-based positions of the refused rollouts.
PRODUCE_LUA = """
if redis.call('EXISTS', KEYS[8]) == 1 then
  return {'finished', 0}
end
local limit = tonumber(ARGV[2])
if limit >= 0 then
  local calls = #KEYS - 9
  local backlog = tonumber(redis.call('GET', KEYS[2]) or '0') - tonumber(redis.call('GET', KEYS[3]) or '0')
  if (redis.call('GET', KEYS[5]) or '') ~= ARGV[4] then
    return {'moved', backlog}
  end
  if backlog + calls > limit then
    return {'backlog', backlog}
  end
  if backlog + calls > tonumber(ARGV[3]) then
    return {'gate_held', backlog}
  end
  local held = tonumber(redis.call('GET', KEYS[7]) or '0')
  local budget = tonumber(ARGV[5])
  if budget >= 0 and backlog >= tonumber(ARGV[6]) and held + tonumber(ARGV[7]) > budget then
    return {'bytes', held}
  end
end
local reply = {'ok', 0}
for i = 10, #KEYS do
  local at = 8 + (i - 10) * 5
  if redis.call('SET', KEYS[i], ARGV[at], 'NX', 'EX', ARGV[1]) then
    if ARGV[at + 4] == '' then
      redis.call('XADD', KEYS[1], '*', 'record', ARGV[at + 1], 'facts', ARGV[at + 2])
    else
      redis.call('XADD', KEYS[1], '*', 'record', ARGV[at + 1], 'facts', ARGV[at + 2], 'credit', ARGV[at + 4])
    end
    redis.call('INCR', KEYS[2])
    redis.call('HSET', KEYS[6], string.match(KEYS[i], ':rollout:(.*)$'), ARGV[at + 3])
    redis.call('INCRBY', KEYS[7], ARGV[at + 3])
    redis.call('HINCRBY', KEYS[9], 'produced_bytes', ARGV[at + 3])
  else
    redis.call('INCR', KEYS[4])
    table.insert(reply, i - 9)
  end
end
for _, key in ipairs({KEYS[1], KEYS[2], KEYS[4], KEYS[6], KEYS[7], KEYS[9]}) do
  redis.call('EXPIRE', key, ARGV[1])
end
return reply
"""

FIXED_KEYS = 9  # the script's keys before the per-rollout ones
