"""Producers: how rollouts enter rlship.

A producer stores a rollout's arrays under its key and appends the small record to the
rollout stream, in one script (`RolloutProducer`, `AsyncRolloutProducer`); an id that is
stored already is refused, counted, and its record not appended. A producer made for a run
is admitted by it in the same script (`Admission`): it writes only what the run can still
train, so a stalled run's stream and payloads stay bounded.
`rlship produce` (orchestrator.commands.produce) is a producer of synthetic rollouts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import redis
import redis.asyncio as aioredis

from orchestrator.policy import NO_VERSION
from orchestrator.records import RolloutRecord
from orchestrator.settings import RunSettings
from tasks.stages.finalize import PayloadFacts, check_rollout_arrays
from transport.keys import RunKeys
from transport.numbering import required_version, version_after
from transport.payload_segments import (
    ANYWHERE,
    PAYLOAD_FIELD,
    RunRows,
    SideArrays,
    rollout_rows_path,
    write_segment_file,
)
from transport.replication import Durability
from transport.schema import EncodedTensor, SchemaError
from transport.store import DEFAULT_TTL_SECONDS, flat_arrays, pack_arrays

Rollouts = list[tuple[RolloutRecord, Mapping[str, np.ndarray]]]


class RolloutRejected(ValueError):
    """Rollouts that were not written, each with why (naming the field and the value)."""

    def __init__(self, problems: dict[str, str]) -> None:
        super().__init__("; ".join(f"rollout {rid!r}: {problem}" for rid, problem in problems.items()))
        self.problems = problems


# KEYS: the rollout stream, the produced and accounted counters, the refused-writes counter,
# the run's next step, the held-bytes hash and total, then one payload key per rollout. ARGV:
# the TTL, the backlog limit (-1: not admitted), the room the policy gate leaves, the next
# step that room was worked out for (as read, '' if unset), the byte budget (-1: none), the
# batch size, the call's bytes, then per rollout its arrays blob, its record, its
# `PayloadFacts` and its bytes (blob and rows files). The call is admitted whole or not at
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
# Returns the verdict, the backlog, then the 1-based positions of the refused rollouts.
_PRODUCE_LUA = """
local limit = tonumber(ARGV[2])
if limit >= 0 then
  local calls = #KEYS - 7
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
for i = 8, #KEYS do
  local at = 8 + (i - 8) * 4
  if redis.call('SET', KEYS[i], ARGV[at], 'NX', 'EX', ARGV[1]) then
    redis.call('XADD', KEYS[1], '*', 'record', ARGV[at + 1], 'facts', ARGV[at + 2])
    redis.call('INCR', KEYS[2])
    redis.call('HSET', KEYS[6], string.match(KEYS[i], ':rollout:(.*)$'), ARGV[at + 3])
    redis.call('INCRBY', KEYS[7], ARGV[at + 3])
  else
    redis.call('INCR', KEYS[4])
    table.insert(reply, i - 7)
  end
end
for _, key in ipairs({KEYS[1], KEYS[2], KEYS[4], KEYS[6], KEYS[7]}) do
  redis.call('EXPIRE', key, ARGV[1])
end
return reply
"""

ADMISSION_POLL_SECONDS = 0.05
# The inline side arrays a run that keeps payloads out of Redis keeps in files until the cut.
ROWS_OUT_OF_REDIS = ("routed_experts",)


class AdmissionRefused(RuntimeError):
    """A call the run does not admit; nothing of it was written. `reason`: backlog, gate_held
    or bytes (it passes: `produce(..., timeout=...)` waits), would_be_stale or too_large (it
    never passes)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"produce refused ({reason}): {message}")
        self.reason = reason

    @property
    def passes(self) -> bool:
        """Whether waiting cures it (backlog, gate held, bytes held): the run admits the call
        once it has room."""
        return self.reason in PASSING_REFUSALS


PASSING_REFUSALS = frozenset({"backlog", "gate_held", "bytes"})


@dataclass(frozen=True)
class Admission:
    """What a run admits from its producers: no more outstanding rollouts than its limit,
    none beyond what the policy gate lets it train soon, and none already stale."""

    limit: int
    batch_size: int
    group_size: int
    first_step: int
    start_step: int
    max_async_level: int
    max_off_policy_steps: int
    max_held_bytes: int = 0  # 0: no byte budget

    @classmethod
    def for_run(cls, settings: RunSettings) -> Admission:
        """The same-named settings; `limit` is the backlog the run allows (`outstanding_limit`)."""
        return cls(**settings.values_for(cls, limit=settings.outstanding_limit))

    @property
    def largest_call(self) -> int:
        """Rollouts one call may hold: a batch (or a group, if larger), within the limit."""
        return min(self.limit, max(self.batch_size, self.group_size))

    def gate_room(self, version: int, next_step: int) -> int:
        """The backlog the gate leaves room for: a batch for each step it lets the run cut
        from `next_step` on at policy `version`, and one more, so that the next step to open
        finds its batch ready; and one call less a rollout on top, so that a batch one short
        (some rollouts of a group are discarded) can always be completed. While the gate
        holds, nothing more is admitted once a batch is pending."""
        required = required_version(next_step, self.first_step, self.max_async_level)
        steps = max(0, version - required + 1)
        return (steps + 1) * self.batch_size + self.largest_call - 1

    def refuse_oversize(self, rollouts: Rollouts, sizes: list[int]) -> None:
        """A rollout, a call or a step (a batch of rollouts like these) larger than the byte
        budget could never be admitted: refused at once, naming its size and the budget."""
        budget = self.max_held_bytes
        if budget <= 0:
            return
        tail = f"more than the run's budget of {budget:,} bytes (max_held_bytes)"
        for (record, _), size in zip(rollouts, sizes, strict=True):
            if size > budget:
                raise AdmissionRefused(
                    "too_large",
                    f"rollout {record.rollout_id!r} holds {size:,} bytes (blob and rows files), {tail}",
                )
        if sum(sizes) > budget:
            raise AdmissionRefused(
                "too_large", f"this call of {len(sizes)} rollouts holds {sum(sizes):,} bytes, {tail}"
            )
        step = self.batch_size * sum(sizes) // len(sizes)
        if step > budget:
            raise AdmissionRefused(
                "too_large",
                f"a step of {self.batch_size} rollouts like these holds about {step:,} bytes, {tail}",
            )

    def oldest_fresh_version(self, next_step: int) -> int:
        """The oldest policy version that is not stale at `next_step`, the earliest step a
        rollout produced now can ship in (`staleness`, the orchestrator's rule)."""
        return version_after(next_step, self.first_step) - 1 - self.max_off_policy_steps


@dataclass(frozen=True)
class _Gate:
    """What a producer read of the run before its call: admission's arguments."""

    version: int
    next_step: int
    room: int
    next_step_read: str  # as read ('' if unset): the script admits only while it stands


def check_rollouts(
    rollouts: Rollouts, max_tokens: int, vocab_size: int, side_arrays: SideArrays = ANYWHERE
) -> list[Mapping[str, Any]]:
    """The workers' own payload checks, run where the bad data is made (the producer), and
    one id given twice in the same call; returns each rollout's checked arrays."""
    problems = {}
    checked = []
    seen: set[str] = set()
    for record, arrays in rollouts:
        if record.rollout_id in seen:
            problems[record.rollout_id] = f"rollout_id: {record.rollout_id!r} appears twice in this call"
            continue
        seen.add(record.rollout_id)
        try:
            flat = flat_arrays(arrays)
        except SchemaError as exc:
            problems[record.rollout_id] = str(exc)
            continue
        # Arrays as numpy; mm_kwargs tensors and payload segments as they are.
        arrays = {
            k: v if isinstance(v, EncodedTensor) or k == PAYLOAD_FIELD else np.asarray(v)
            for k, v in flat.items()
        }
        problem = check_rollout_arrays(arrays, record.num_tokens, max_tokens, vocab_size, side_arrays)
        if problem is not None:
            problems[record.rollout_id] = problem
        checked.append(arrays)
    if problems:
        raise RolloutRejected(problems)
    return checked


class _Producer:
    """What both producer APIs share. Records are validated by their pydantic model; arrays
    by the workers' checks against the run's limits (`max_tokens` as its `seq_len`, and its
    vocabulary; by default those of a run with default settings), so a bad rollout fails
    where it is made, naming its field and value. With an `Admission` (`for_run`), a call
    is written only if the run admits it (`AdmissionRefused`); without one (a workload
    written up front, as tests do), every call is written."""

    def __init__(
        self,
        client: redis.Redis | aioredis.Redis,
        run_id: str,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        max_tokens: int = RunSettings.model_fields["seq_len"].default,
        vocab_size: int = RunSettings.model_fields["vocab_size"].default,
        admission: Admission | None = None,
        durability: Durability | None = None,
        side_arrays: SideArrays = ANYWHERE,
        rows_out_of_redis: RunRows | None = None,
    ) -> None:
        self.client = client
        self.keys = RunKeys(run_id)
        # A rollout is acknowledged (produce returns) once the run's replicas hold it.
        self.durability = durability or Durability(0, 0, self.keys.replication_probe)
        self.ttl = ttl_seconds
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self.admission = admission
        self.side_arrays = side_arrays
        self.rows_out_of_redis = rows_out_of_redis
        self._produce = client.register_script(_PRODUCE_LUA)
        self._gate_keys = [self.keys.known_policy_version, self.keys.next_step]

    @classmethod
    def for_run(cls, client: Any, settings: RunSettings, admitted: bool = True) -> Self:
        """A producer checking rollouts against the run's `seq_len` and vocabulary and, unless
        `admitted` is False, admitted by the run's limits."""
        return cls(
            client,
            settings.run_id,
            max_tokens=settings.seq_len,
            vocab_size=settings.vocab_size,
            admission=Admission.for_run(settings) if admitted else None,
            durability=Durability.of(settings, RunKeys(settings.run_id).replication_probe),
            side_arrays=settings.ship_config().side_arrays,
            rows_out_of_redis=settings.run_rows() if settings.payload_store == "dir" else None,
        )

    def _stored(self, keys: list[str]) -> tuple[Any, Any]:
        """The witness that a call's rollouts are stored (their payload keys), for `Durability`."""
        payload_keys = keys[7:]
        return (lambda pipe: pipe.exists(*payload_keys)), (lambda found: found[0] == len(payload_keys))

    def _script_arguments(self, rollouts: Rollouts) -> tuple[list[str], list[Any]]:
        """Check every rollout (RolloutRejected, nothing written, if any is bad), then the
        script's keys and per-rollout arguments: arrays before records, so a record never
        points at a payload not there yet."""
        checked = check_rollouts(rollouts, self.max_tokens, self.vocab_size, self.side_arrays)
        keys = [
            self.keys.rollout_stream,
            self.keys.produced,
            self.keys.accounted,
            self.keys.refused_writes,
            self.keys.next_step,
            self.keys.held_bytes,
            self.keys.held_bytes_total,
        ]
        args: list[Any] = []
        sizes = []
        for (record, _), flat in zip(rollouts, checked, strict=True):
            keys.append(self.keys.rollout(record.rollout_id))
            stored = self._rows_to_files(record.rollout_id, flat)
            blob = pack_arrays(stored)
            # Segments are checked again at the cut, against the files as they are then.
            facts = PayloadFacts.of(stored, len(blob)).to_wire()
            sizes.append(len(blob) + sum(segment.nbytes for segment in stored.get(PAYLOAD_FIELD, [])))
            args += [blob, record.model_dump_json(), facts, sizes[-1]]
        if self.admission is not None:
            self.admission.refuse_oversize(rollouts, sizes)
        return keys, [sum(sizes), *args]

    def _rows_to_files(self, rollout_id: str, arrays: Mapping[str, Any]) -> Mapping[str, Any]:
        """With the run's payloads kept out of Redis, its inline side arrays wait for the cut
        in the run's rows files too (the encoder reads them back into the micro-batch)."""
        moved = {name: arrays[name] for name in ROWS_OUT_OF_REDIS if name in arrays}
        if self.rows_out_of_redis is None or not moved:
            return arrays
        rows = self.rows_out_of_redis
        path = rollout_rows_path(rows.root, rows.run_id, rollout_id, inline=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        segments = write_segment_file(path, moved, inline=True)
        kept = {name: value for name, value in arrays.items() if name not in moved}
        return kept | {PAYLOAD_FIELD: [*arrays.get(PAYLOAD_FIELD, []), *segments]}

    def _gate(self, rollouts: Rollouts, known: bytes | None, next_step: bytes | None) -> _Gate:
        """Admission's view of the run (the orchestrator's policy version and next step, both
        only ever rising, so a read that is late errs on the safe side); refuses at once what
        waiting cannot cure."""
        assert self.admission is not None
        if len(rollouts) > self.admission.largest_call:
            raise AdmissionRefused(
                "too_large",
                f"{len(rollouts)} rollouts in one call; the run admits at most "
                f"{self.admission.largest_call} at once (a batch, or a group if larger)",
            )
        version = int(known if known is not None else NO_VERSION)
        step = int(next_step) if next_step is not None else self.admission.start_step
        oldest = self.admission.oldest_fresh_version(step)
        for record, _ in rollouts:
            if record.policy_version < oldest:
                raise AdmissionRefused(
                    "would_be_stale",
                    f"rollout {record.rollout_id!r} has policy version {record.policy_version}, older "
                    f"than {oldest}, the oldest the run's next step {step} may train "
                    f"(max_off_policy_steps {self.admission.max_off_policy_steps})",
                )
        read = next_step.decode() if next_step is not None else ""
        return _Gate(version, step, self.admission.gate_room(version, step), read)

    def _call_arguments(self, gate: _Gate | None, data: list[Any]) -> list[Any]:
        """The script's arguments; `data` is the call's bytes, then the per-rollout ones."""
        if gate is None or self.admission is None:
            return [self.ttl, -1, -1, "", -1, 0, *data]
        budget = self.admission.max_held_bytes or -1
        batch = self.admission.batch_size
        return [self.ttl, self.admission.limit, gate.room, gate.next_step_read, budget, batch, *data]

    @staticmethod
    def _waits_out(refused: AdmissionRefused, deadline: float) -> bool:
        """Whether `produce` waits and tries again: a refusal that passes, before the deadline."""
        return refused.passes and time.monotonic() < deadline

    def _verdict(self, rollouts: Rollouts, gate: _Gate | None, reply: list[Any]) -> bool:
        """Whether the call is done (False: a step was cut meanwhile, admission is worked out
        again); raise what the script refused: the whole call, or some of its ids."""
        verdict, backlog, *refused = reply
        if verdict == b"moved":
            return False
        if verdict == b"backlog":
            assert self.admission is not None
            raise AdmissionRefused(
                "backlog",
                f"{backlog} rollouts outstanding (in the stream, in open groups or pending, not yet "
                f"cut) and {len(rollouts)} more exceed the run's limit of {self.admission.limit} "
                "(max_outstanding_rollouts)",
            )
        if verdict == b"bytes":
            assert self.admission is not None
            raise AdmissionRefused(
                "bytes",
                f"the run holds {int(backlog):,} bytes (rollouts not yet released, their rows files, "
                f"retained payloads) and {len(rollouts)} rollouts more would pass its budget of "
                f"{self.admission.max_held_bytes:,} bytes (max_held_bytes)",
            )
        if verdict == b"gate_held":
            assert self.admission is not None and gate is not None
            required = required_version(
                gate.next_step, self.admission.first_step, self.admission.max_async_level
            )
            raise AdmissionRefused(
                "gate_held",
                f"{backlog} rollouts outstanding and {len(rollouts)} more exceed the {gate.room} the "
                f"policy gate leaves room for: the trainers' policy version is {gate.version} and "
                f"the run's next step {gate.next_step} needs version {required}",
            )
        if refused:
            problem = (
                "rollout_id: already stored for this run; the original is kept and this write was "
                "refused (the others of the call were written)"
            )
            raise RolloutRejected({rollouts[position - 1][0].rollout_id: problem for position in refused})
        return True


class RolloutProducer(_Producer):
    """Synchronous producer API (for inference/env workers)."""

    client: redis.Redis

    def produce(self, rollouts: Rollouts, timeout: float | None = None) -> None:
        """Write the rollouts, or raise: RolloutRejected (bad data, a duplicate id), or
        AdmissionRefused; a refusal that passes (backlog, gate held) is waited out for up
        to `timeout` seconds, if given."""
        keys, data = self._script_arguments(rollouts)
        deadline = time.monotonic() + (timeout or 0.0)

        def write() -> None:
            while True:
                try:
                    known = self.client.mget(self._gate_keys) if self.admission else None
                    gate = self._gate(rollouts, *known) if known is not None else None
                    reply = self._produce(keys=keys, args=self._call_arguments(gate, data))
                    if self._verdict(rollouts, gate, reply):
                        return
                except AdmissionRefused as exc:
                    if not self._waits_out(exc, deadline):
                        raise
                    time.sleep(ADMISSION_POLL_SECONDS)

        witness, holds = self._stored(keys)
        self.durability.replicate(self.client, write, witness, f"{len(rollouts)} rollouts", holds)

    def outstanding(self) -> int:
        """Rollouts appended but not yet accounted for by the orchestrator (shipped or discarded)."""
        produced, accounted = self.client.mget(self.keys.produced, self.keys.accounted)
        return int(produced or 0) - int(accounted or 0)

    def policy_version(self) -> int:
        """The trainers' policy version as the orchestrator knows it (0 before it knows one):
        the version to stamp on rollouts sampled now."""
        return max(0, int(self.client.get(self.keys.known_policy_version) or 0))


class AsyncRolloutProducer(_Producer):
    """The same on `redis.asyncio`, for producers that live on an event loop."""

    client: aioredis.Redis

    async def produce(self, rollouts: Rollouts, timeout: float | None = None) -> None:
        keys, data = self._script_arguments(rollouts)
        deadline = time.monotonic() + (timeout or 0.0)

        async def write() -> None:
            while True:
                try:
                    known = await self.client.mget(self._gate_keys) if self.admission else None
                    gate = self._gate(rollouts, *known) if known is not None else None
                    reply = await self._produce(keys=keys, args=self._call_arguments(gate, data))
                    if self._verdict(rollouts, gate, reply):
                        return
                except AdmissionRefused as exc:
                    if not self._waits_out(exc, deadline):
                        raise
                    await asyncio.sleep(ADMISSION_POLL_SECONDS)

        witness, holds = self._stored(keys)
        await self.durability.replicate_async(self.client, write, witness, f"{len(rollouts)} rollouts", holds)
