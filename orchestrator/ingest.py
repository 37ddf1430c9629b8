"""Ingest: rollout records from the run's Redis stream, into groups, into fates.

A record joins its group; a complete group's rollouts get their fates (orchestrator.groups):
trainable ones wait in `pending` for a cut (and go to the workers to be prepared for the
wire meanwhile), the others are counted and their payloads released at once. Every
finalized rollout also goes to the `window` of `all` statistics the next cut carries.
Ingest owns the stream cursor, the open groups and their stream entries, `pending`,
`window` and the accounting; the cut takes from them through `take`, `take_window`,
`put_back` and `kept`, and restarts from `checkpoint`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis

from orchestrator.accounting import Accounting, outcome_row
from orchestrator.checkpoint import Checkpoint
from orchestrator.group_cancel import CANCEL_FIELD, parse_cancellation
from orchestrator.groups import CANCELLED, TRAINABLE, GroupBuffer, Outcome, decide_group
from orchestrator.records import IDENTIFIER, RecordRejected, parse_record
from orchestrator.rollout_log import RolloutLog
from orchestrator.settings import RunSettings
from tasks.cohort import Cohort, CohortBuilder
from tasks.manifest import StepManifest
from tasks.stages.credit import GivenCredit
from tasks.stages.finalize import PayloadFacts
from transport.keys import DEFAULT_TTL_SECONDS, RunKeys
from transport.numbering import staleness
from transport.outcomes import Written, discarded, record_outcomes, rejected
from transport.release_scripts import release_rollouts
from transport.replication import Durability

log = logging.getLogger("rlship.orchestrator")

READ_BATCH = 128  # records handled per turn of the loop: a few ms, then other tasks run
READ_BLOCK_MS = 100


class Ingest:
    def __init__(
        self,
        settings: RunSettings,
        client: aioredis.Redis,
        rollout_log: RolloutLog,
        stopping: asyncio.Event,
        work: asyncio.Event,
        next_step: Callable[[], int],
        status: Callable[[], dict[str, float]],
        prepare: Callable[[list[str]], Awaitable[None]] | None = None,
    ) -> None:
        # Given.
        self.settings = settings
        self.client = client
        self.keys = RunKeys(settings.run_id)
        self.ttl = DEFAULT_TTL_SECONDS
        self.rows = settings.run_rows()
        self.rollout_log = rollout_log
        self.durability = Durability.of(settings, self.keys.replication_probe)
        self.stopping = stopping
        self.work = work  # set once there are rollouts enough for a cut
        self.next_step = next_step  # the step the next cut makes: staleness counts from it
        self.status = status  # the run's status, written every turn
        # Hands the workers the rollouts of groups completed trainable in a turn, to make
        # their wire parts before the cut (tasks.ship.prepare); None: nothing is prepared.
        self.prepare = prepare
        self.completed_trainable: list[str] = []
        # What became of the rollouts rejected or discarded this turn, for their producers.
        self.outcomes: dict[str, Written] = {}
        # Read and taken; `resume` replaces pending and accounting with the checkpoint's.
        self.groups = GroupBuffer(settings.group_size, memory=settings.dedupe_horizon)
        self.pending = CohortBuilder()  # trainable rows, in completion order, cut from the front
        self.window = CohortBuilder()  # every rollout finalized since the last cut
        self.accounting = Accounting()
        self.stream_cursor = "0-0"
        # Stream entry of every rollout in an open group, oldest first (insertion order):
        # the stream is trimmed no further than the oldest, so a restart can re-read them.
        self.open_entries: dict[str, str] = {}
        # The producer's facts of every rollout in an open group that came with them: they
        # join its cohort row, so finalize need not read its arrays (tasks.stages.finalize).
        self.open_facts: dict[str, PayloadFacts] = {}
        # The producer's summary of every rollout in an open group that came with credit of
        # its own (tasks.stages.credit): its fate and trainable tokens follow from it.
        self.open_credit: dict[str, GivenCredit] = {}
        self.resumed_from: Checkpoint | None = None
        # A cut taken from `pending` whose transaction (new `next_step`, its `accounted`) has
        # not landed: `accounted` is not written meanwhile (`cutting`).
        self._cut_unwritten = False

    async def run(self) -> None:
        """Read rollout records until stopped; complete groups; release what cannot train."""
        while not self.stopping.is_set():
            entries = await self.read_replicated()
            release_ids: list[str] = []
            for entry_id, fields in entries:
                if CANCEL_FIELD in fields:
                    release_ids.extend(self.cancel_group(entry_id.decode(), fields[CANCEL_FIELD]))
                    continue
                release_ids.extend(
                    self.take_record(
                        entry_id.decode(),
                        fields.get(b"record", b""),
                        fields.get(b"facts"),
                        fields.get(b"credit"),
                    )
                )
            if entries:
                self.stream_cursor = entries[-1][0].decode()
            pipe = self.client.pipeline(transaction=False)
            if release_ids:
                await release_rollouts(pipe, self.keys, release_ids)
            if self.outcomes:
                await self.write_outcomes(pipe)
            # Every turn, with rollouts or without (the gate holds the producers, or they are
            # done): the status says what was cut and published since (`rlship status`), and
            # an `accounted` held back during a cut is written, or producers could wait on it.
            if not self._cut_unwritten:
                pipe.set(self.keys.accounted, self.accounting.accounted, ex=DEFAULT_TTL_SECONDS)
            pipe.hset(self.keys.status, mapping=self.status())
            pipe.expire(self.keys.status, DEFAULT_TTL_SECONDS)
            await pipe.execute()
            if release_ids and self.rows.exists():
                await asyncio.to_thread(self.rows.unlink, release_ids)
            if self.completed_trainable:
                completed, self.completed_trainable = self.completed_trainable, []
                if self.prepare is not None:
                    await self.prepare(completed)
            if len(self.pending) >= self.settings.batch_size:
                self.work.set()

    async def read_replicated(self) -> list[Any]:
        """The stream's next records, once replicas hold them (`redis_wait_replicas`): a record
        read on a primary that dies before a replica has it is written again by its producer,
        which is still waiting for its own confirmation; taken twice, it would be counted
        twice. Records found lost are read again, from the same cursor, on the new primary."""
        while True:
            response = await self.client.xread(
                {self.keys.rollout_stream: self.stream_cursor}, count=READ_BATCH, block=READ_BLOCK_MS
            )
            entries = response[0][1] if response else []
            if not entries or not self.durability.replicas:
                return entries
            last = entries[-1][0]
            what = f"{len(entries)} rollout records read"
            if await self.durability.held_async(
                self.client,
                lambda pipe, last=last: pipe.xrange(self.keys.rollout_stream, last, last),
                what,
                given_up=self.stopping.is_set,
            ):
                return entries
            if self.stopping.is_set():
                return []  # left in the stream, past the checkpoint's cursor, for a resume
            log.warning("%s were lost in a failover before a replica had them; reading again", what)

    def take_record(
        self, entry_id: str, raw: bytes, facts: bytes | None = None, credit: bytes | None = None
    ) -> list[str]:
        """Account one stream record (with its producer's facts and credit summary, if it
        came with them); return the rollout ids whose payloads to release.

        After a restart, a record the checkpoint covers is taken again only if its rollout
        was in an open group then (it was counted as arrived already)."""
        if self.resumed_from is not None and self.resumed_from.covers(entry_id):
            if _rollout_id_of(raw) not in self.resumed_from.open_rollouts:
                return []
        else:
            self.accounting.arrived += 1
        try:
            record = parse_record(raw)
            envs = self.settings.envs
            if envs is not None and record.env not in envs:
                raise RecordRejected(
                    "unknown_env", f"env: {record.env!r} is not one of the run's envs {envs}"
                )
            given = _given_credit(credit)
            group = self.groups.add(record)
        except RecordRejected as exc:
            self.accounting.rejected[exc.reason] += 1
            log.warning("rollout record rejected (%s): %s", exc.reason, exc)
            rollout_id = _rollout_id_of(raw)
            # A duplicate's id is the original's: its outcome and payload stay the original's.
            if rollout_id is None or exc.reason == "duplicate_rollout":
                return []
            self.outcomes[rollout_id] = rejected(exc.reason, str(exc))
            return [rollout_id]
        checked = PayloadFacts.from_wire(facts)
        if checked is not None:
            self.open_facts[record.rollout_id] = checked
        if given is not None:
            self.open_credit[record.rollout_id] = given
        if group is None:
            self.open_entries[record.rollout_id] = entry_id
            return []
        for member in group:
            self.open_entries.pop(member.rollout_id, None)
        group_facts = {m.rollout_id: self.open_facts.pop(m.rollout_id, None) for m in group}
        popped = ((m.rollout_id, self.open_credit.pop(m.rollout_id, None)) for m in group)
        given_credit = {rollout_id: credit for rollout_id, credit in popped if credit is not None}
        released = []
        for outcome in decide_group(
            group,
            self.next_step(),
            self.settings.max_off_policy_steps,
            self.settings.normalize_advantages,
            self.settings.first_step,
            given_credit,
            self.settings.length_penalty,
        ):
            rollout_id = outcome.record.rollout_id
            row = outcome_row(outcome, group_facts[rollout_id], given_credit.get(rollout_id))
            self.window.append(*row)
            self.rollout_log.finalized(outcome)
            if outcome.fate == TRAINABLE:
                self.pending.append(*row)
                self.completed_trainable.append(outcome.record.rollout_id)
            else:
                self.accounting.discard(outcome.fate)
                released.append(outcome.record.rollout_id)
                self.outcomes[outcome.record.rollout_id] = discarded(outcome.fate)
        return released

    def cancel_group(self, entry_id: str, raw: bytes) -> list[str]:
        """Take a producer's cancellation of a group (orchestrator.group_cancel): the group's
        rollouts arrived so far are discarded (`cancelled`) and returned to release at once;
        later ones are rejected. A group complete already is left to its fates."""
        try:
            env, group_id = parse_cancellation(raw)
        except ValueError as exc:
            log.warning("group cancellation ignored: %s", exc)
            return []
        members = self.groups.cancel(env, group_id)
        if self.resumed_from is not None and self.resumed_from.covers(entry_id):
            return []  # taken before the restart (its rollouts left then); later ones still rejected
        if members is None:
            log.info("group %r of env %r was cancelled after it completed: its fates stand", group_id, env)
            return []
        self.accounting.cancelled_groups += 1
        for record in members:
            self.open_entries.pop(record.rollout_id, None)
            facts = self.open_facts.pop(record.rollout_id, None)
            credit = self.open_credit.pop(record.rollout_id, None)
            outcome = Outcome(record.model_copy(update={"cancelled": True}), 0.0, CANCELLED)
            self.window.append(*outcome_row(outcome, facts, credit))
            self.rollout_log.finalized(outcome)
            self.accounting.discard(CANCELLED)
            self.outcomes[record.rollout_id] = discarded(CANCELLED)
        return [record.rollout_id for record in members]

    async def write_outcomes(self, client: aioredis.Redis | Any) -> None:
        """Write the outcomes decided since the last write (on a client or a pipeline)."""
        outcomes, self.outcomes = self.outcomes, {}
        for call in record_outcomes(client, self.keys, outcomes, self.settings.dedupe_horizon, self.ttl):
            await call

    # -- what the cut takes, and gives back --------------------------------------------

    def drop_stale(self, step: int) -> list[str]:
        """Pending rollouts that went stale while waiting are discarded at the cut."""
        versions = self.pending.column("policy_version")
        stale = staleness(step, versions, self.settings.first_step) > self.settings.max_off_policy_steps
        if not stale.any():
            return []
        removed = self.pending.remove(stale)
        self.accounting.discard("stale", len(removed))
        stale_ids = removed.labels["rollout_id"]
        self.outcomes.update(dict.fromkeys(stale_ids, discarded("stale")))
        return stale_ids

    @asynccontextmanager
    async def cutting(self) -> AsyncIterator[None]:
        """While a cut is taken and written: producers' admission reads `accounted` and
        `next_step` apart, so `accounted` with the cut in it must not land before the cut's
        transaction moves `next_step` on (the backlog would drop while the room of the old
        step still stands, and a producer would fill it: a batch too many once it moves).
        Discards counted meanwhile are written with the cut or the next turn."""
        self._cut_unwritten = True
        try:
            yield
        finally:
            self._cut_unwritten = False

    def take(self, count: int) -> Cohort:
        """The oldest `count` pending rollouts (all, if fewer), counted as cut."""
        batch = self.pending.take(count)
        self.accounting.cut += len(batch)
        return batch

    def take_window(self) -> Cohort:
        """The `all` statistics since the last cut; the next window starts empty."""
        window, self.window = self.window.build(), CohortBuilder()
        return window

    def put_back(self, manifest: StepManifest, dropped: dict[str, int]) -> int:
        """Undo a cut the workers emptied (`dropped`: its rollouts by the field they were
        dropped for): its rollouts are discarded (`empty_step`) and its window goes to the
        next cut. Returns the empty cuts in a row, this one included."""
        self.accounting.empty_cut(len(manifest.effective), dropped)
        self.accounting.stale_in_window += int(manifest.counters.get("off_policy/stale_dropped", 0))
        self.window = CohortBuilder.from_cohort(Cohort.concat([manifest.window, self.window.build()]))
        return self.accounting.empty_in_a_row

    def kept(self) -> None:
        """A cut the workers shipped: the empty cuts before it are no longer in a row."""
        self.accounting.empty_in_a_row = 0

    def oldest_held(self) -> str:
        """The oldest stream entry a restart must re-read: the stream is trimmed to it."""
        return next(iter(self.open_entries.values()), self.stream_cursor)

    def checkpoint(self) -> Checkpoint:
        """The restart point as of now (orchestrator.checkpoint)."""
        return Checkpoint(
            cursor=self.stream_cursor,
            open_rollouts=frozenset(self.open_entries),
            pending=self.pending.build(),
            accounting=self.accounting.to_wire(),
        )

    def resume(self, checkpoint: Checkpoint) -> None:
        """Start from a previous orchestrator's checkpoint: its counters and pending rollouts;
        the records it read are taken again only for the rollouts then in open groups."""
        self.resumed_from = checkpoint
        self.pending = CohortBuilder.from_cohort(checkpoint.pending)
        self.accounting = Accounting.from_wire(checkpoint.accounting)


def _rollout_id_of(raw: bytes) -> str | None:
    """The rollout id of a rejected record, if it names a well-formed one (to release it)."""
    try:
        value = json.loads(raw).get("rollout_id")
    except (ValueError, AttributeError, RecursionError):  # RecursionError: JSON nested too deep
        return None
    return value if isinstance(value, str) and IDENTIFIER.fullmatch(value) else None


def _given_credit(data: bytes | None) -> GivenCredit | None:
    """A stream entry's credit summary (None: the group baseline's), or RecordRejected."""
    try:
        return GivenCredit.from_wire(data)
    except ValueError as exc:
        raise RecordRejected("invalid_credit", str(exc)) from None
