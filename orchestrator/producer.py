"""Producers: how rollouts enter rlship.

A producer stores a rollout's arrays under its key and appends the small record to the
rollout stream, in one script (`RolloutProducer`, `AsyncRolloutProducer`); an id that is
stored already is refused, counted, and its record not appended. A producer made for a run
(`for_run`) knows the run: it checks each call against the run's stored settings
(orchestrator.stored_settings: seq_len, vocabulary, groups, envs, the wire's side arrays;
orchestrator.rollout_checks), so nothing it writes is dropped at the cut for the run's own
limits, and it is admitted by the run in the same script as the write
(orchestrator.admission). `outcome` tells it what became of its rollouts.
`rlship produce` (orchestrator.commands.produce) is a producer of synthetic rollouts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any, Self

import redis
import redis.asyncio as aioredis

from orchestrator.admission import FINISHED, Admission, AdmissionRefused, GateView, Rollouts
from orchestrator.group_cancel import cancellation_entry
from orchestrator.policy import NO_VERSION
from orchestrator.produce_script import FIXED_KEYS, PRODUCE_LUA
from orchestrator.rollout_checks import RolloutRejected, call_problems, check_rollouts
from orchestrator.settings import RunSettings
from orchestrator.stored_settings import read_run_settings, read_run_settings_async
from tasks.stages.credit import GivenCredit
from tasks.stages.finalize import PayloadFacts
from transport.arrays_blob import pack_arrays
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys
from transport.numbering import required_version
from transport.outcomes import RolloutOutcome, outcome_call, parse_outcomes
from transport.payload_segments import (
    ANYWHERE,
    PAYLOAD_FIELD,
    RunRows,
    SideArrays,
    rollout_rows_path,
    write_segment_file,
)
from transport.replication import Durability

__all__ = [
    "AdmissionRefused",
    "AsyncRolloutProducer",
    "RolloutOutcome",
    "RolloutProducer",
    "RolloutRejected",
    "Rollouts",
]

ADMISSION_POLL_SECONDS = 0.05
# The inline side arrays a run that keeps payloads out of Redis keeps in files until the cut.
ROWS_OUT_OF_REDIS = ("routed_experts",)


class _Producer:
    """What both producer APIs share. Records are validated by their pydantic model; arrays
    by the workers' checks against the run's limits (`max_tokens` as its `seq_len`, and its
    vocabulary; by default those of a run with default settings), so a bad rollout fails
    where it is made, naming its field and value. Made for a run (`for_run`), it checks
    against the run's stored settings, refuses what the run would reject for its groups and
    envs, and writes a call only if the run admits it (`AdmissionRefused`); made directly
    (a workload written up front, as tests do), every well-formed call is written."""

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
        self.settings: RunSettings | None = None  # the run's, once known (`for_run`)
        self._produce = client.register_script(PRODUCE_LUA)
        self._gate_keys = [self.keys.known_policy_version, self.keys.next_step]

    def _know_run(self, settings: RunSettings, admitted: bool) -> None:
        """Check every call against the run's `settings` from now on."""
        self.settings = settings
        self.max_tokens = settings.seq_len
        self.vocab_size = settings.vocab_size
        self.admission = Admission.for_run(settings) if admitted else None
        self.durability = Durability.of(settings, self.keys.replication_probe)
        self.side_arrays = settings.ship_config().side_arrays
        self.rows_out_of_redis = settings.run_rows() if settings.payload_store == "dir" else None

    @staticmethod
    def _run_asked(run: str | RunSettings) -> tuple[str, RunSettings | None]:
        return (run.run_id, run) if isinstance(run, RunSettings) else (run, None)

    def _stored(self, keys: list[str]) -> tuple[Any, Any]:
        """The witness that a call's rollouts are stored (their payload keys), for `Durability`."""
        payload_keys = keys[FIXED_KEYS:]
        return (lambda pipe: pipe.exists(*payload_keys)), (lambda found: found[0] == len(payload_keys))

    def _script_arguments(self, rollouts: Rollouts, partial_groups: bool) -> tuple[list[str], list[Any]]:
        """Check every rollout (RolloutRejected, nothing written, if any is bad), then the
        script's keys and per-rollout arguments: arrays before records, so a record never
        points at a payload not there yet."""
        run = self.settings
        found = call_problems(rollouts, run.group_size, run.envs, partial_groups) if run is not None else {}
        checked = check_rollouts(rollouts, self.max_tokens, self.vocab_size, self.side_arrays, found)
        keys = [
            self.keys.rollout_stream,
            self.keys.produced,
            self.keys.accounted,
            self.keys.refused_writes,
            self.keys.next_step,
            self.keys.held_bytes,
            self.keys.held_bytes_total,
            self.keys.finished,
            self.keys.rollout_flow,
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
            credit = GivenCredit.of(flat)
            args += [blob, record.model_dump_json(), facts, sizes[-1], credit.to_wire() if credit else ""]
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
        segments = write_segment_file(path, moved, inline=True)
        kept = {name: value for name, value in arrays.items() if name not in moved}
        return kept | {PAYLOAD_FIELD: [*arrays.get(PAYLOAD_FIELD, []), *segments]}

    def _gate(self, rollouts: Rollouts, known: bytes | None, next_step: bytes | None) -> GateView:
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
        return GateView(version, step, self.admission.gate_room(version, step), read)

    def _call_arguments(self, gate: GateView | None, data: list[Any]) -> list[Any]:
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

    def _verdict(self, rollouts: Rollouts, gate: GateView | None, reply: list[Any]) -> bool:
        """Whether the call is done (False: a step was cut meanwhile, admission is worked out
        again); raise what the script refused: the whole call, or some of its ids."""
        verdict, backlog, *refused = reply
        if verdict == b"moved":
            return False
        if verdict == FINISHED.encode():
            raise AdmissionRefused(
                FINISHED,
                f"run {self.keys.run_id} has finished (it shipped every step): it takes no more rollouts",
            )
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

    @classmethod
    def for_run(
        cls, client: redis.Redis, run: str | RunSettings, admitted: bool = True, wait: float = 0.0
    ) -> Self:
        """A producer for run `run` (its id, or settings naming it) that checks and admits
        each call by the run's own settings, read from Redis (the orchestrator stores them
        at start): up to `wait` seconds are waited for a run not started yet, saying so;
        then `RunNotStarted`. Settings given must agree with the run's (`SettingsDisagree`
        names each difference); given settings of a run not started yet stand as given. With
        `admitted` False the run's limits are checked but its admission is not (a workload
        written up front)."""
        run_id, given = cls._run_asked(run)
        producer = cls(client, run_id)
        producer._know_run(read_run_settings(client, run_id, given, wait), admitted)
        return producer

    def produce(self, rollouts: Rollouts, timeout: float | None = None, partial_groups: bool = False) -> None:
        """Write the rollouts, or raise: RolloutRejected (bad data, a duplicate id, a group
        the run would reject), or AdmissionRefused; a refusal that passes (backlog, gate
        held, bytes) is waited out for up to `timeout` seconds, if given. A producer made
        for a run writes whole groups, unless `partial_groups` says the rest of a group
        comes in later calls."""
        keys, data = self._script_arguments(rollouts, partial_groups)
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

    def cancel_group(self, group_id: str, env: str) -> None:
        """Give up on a group (a rollout of it will never come): its rollouts written so far
        are discarded (`cancelled`) and released at once, later ones rejected
        (orchestrator.group_cancel); InvalidRecord naming a bad group or env."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.rollout_stream, cancellation_entry(env, group_id, self.settings))
        pipe.expire(self.keys.rollout_stream, self.ttl)
        pipe.execute()

    def outcome(self, rollout_ids: Iterable[str]) -> dict[str, RolloutOutcome]:
        """What became of each rollout (transport.outcomes): shipped in a step, cut into one
        not yet published, dropped at the cut and why, discarded or rejected and why,
        pending, or unknown to the run."""
        ids = list(rollout_ids)
        return parse_outcomes(ids, self.client.eval(*_eval_args(outcome_call(self.keys, ids))))

    def outstanding(self) -> int:
        """Rollouts appended but not yet accounted for by the orchestrator (shipped or discarded)."""
        produced, accounted = self.client.mget(self.keys.produced, self.keys.accounted)
        return int(produced or 0) - int(accounted or 0)

    def policy_version(self) -> int:
        """The trainers' policy version as the orchestrator knows it (0 before it knows one):
        the version to stamp on rollouts sampled now."""
        return max(0, int(self.client.get(self.keys.known_policy_version) or 0))


class AsyncRolloutProducer(_Producer):
    """The same on `redis.asyncio`, for producers that live on an event loop. Made for a run,
    it reads the run's settings on its first call (or `await producer.ready()`)."""

    client: aioredis.Redis
    # What `for_run` was asked (given settings, admitted, wait) until `ready` reads the run.
    _asked: tuple[RunSettings | None, bool, float] | None = None

    @classmethod
    def for_run(
        cls, client: aioredis.Redis, run: str | RunSettings, admitted: bool = True, wait: float = 0.0
    ) -> Self:
        """See `RolloutProducer.for_run`; the run's settings are read by `ready`."""
        run_id, given = cls._run_asked(run)
        producer = cls(client, run_id)
        producer._asked = (given, admitted, wait)
        return producer

    async def ready(self) -> None:
        """Read the run's settings, once (`RolloutProducer.for_run` says how)."""
        if self._asked is not None:
            given, admitted, wait = self._asked
            self._know_run(
                await read_run_settings_async(self.client, self.keys.run_id, given, wait), admitted
            )
            self._asked = None

    async def produce(
        self, rollouts: Rollouts, timeout: float | None = None, partial_groups: bool = False
    ) -> None:
        """See `RolloutProducer.produce`."""
        await self.ready()
        keys, data = self._script_arguments(rollouts, partial_groups)
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

    async def cancel_group(self, group_id: str, env: str) -> None:
        """See `RolloutProducer.cancel_group`."""
        await self.ready()
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.rollout_stream, cancellation_entry(env, group_id, self.settings))
        pipe.expire(self.keys.rollout_stream, self.ttl)
        await pipe.execute()

    async def outcome(self, rollout_ids: Iterable[str]) -> dict[str, RolloutOutcome]:
        """See `RolloutProducer.outcome`."""
        ids = list(rollout_ids)
        return parse_outcomes(ids, await self.client.eval(*_eval_args(outcome_call(self.keys, ids))))


def _eval_args(call: tuple[str, list[str], list[str]]) -> tuple[Any, ...]:
    """`client.eval`'s arguments for a script call: the script, how many keys, keys, args."""
    script, keys, args = call
    return (script, len(keys), *keys, *args)
