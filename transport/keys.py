"""Every Redis key name of a run, and nothing else (docs/redis-keys.md is the table).

Every key of a run lives under `rlship:{run_id}:` so runs can share a server and one run
can never name (or delete) another run's keys. Code outside this module asks `RunKeys`
for a key and never spells one, so the layout can be read (and changed) here alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

RUN_PREFIX = "rlship:"
RUN_MARKER = "started_at"  # the one key every run that ever started has (`RunKeys.run_marker`)
# How long a run's key lives unless renewed: every write sets it, the orchestrator's lease
# renews it, and what a run leaves behind expires after it.
DEFAULT_TTL_SECONDS = 24 * 3600


# A rollout key's sibling holding its wire parts (`RunKeys.sample_wire`): wherever a
# rollout's key is deleted, this one goes with it.
WIRE_SUFFIX = ":wire"


class StepValue(StrEnum):
    """The values a step's stages store, each under `step:{n}:{value}` (`RunKeys.step`)."""

    MANIFEST = "manifest"
    FINALIZED = "finalized"
    VERDICT = "verdict"
    PRUNED = "pruned"
    DROPPED = "dropped"
    METRICS = "metrics"
    PLAN = "plan"
    SAMPLES = "samples"  # per rank, `samples:{rank}`: its encode's sample lines, for publish


@dataclass(frozen=True, slots=True)
class RunKeys:
    run_id: str

    def __post_init__(self) -> None:
        if not self.run_id or any(c in self.run_id for c in ":*?[] \n"):
            raise ValueError(f"run_id: {self.run_id!r} must be non-empty, without ':', spaces or globs")

    @property
    def prefix(self) -> str:
        return f"{RUN_PREFIX}{self.run_id}:"

    def rollout(self, rollout_id: str) -> str:
        """A rollout's arrays, written by its producer."""
        return f"{self.prefix}rollout:{rollout_id}"

    def sample_wire(self, rollout_id: str) -> str:
        """A trainable rollout's token fields as they will be on the wire, made before the
        cut (`tasks.stages.encode.SampleWire`); under `rollout:` so that what finds or
        deletes every rollout key of the run finds these too."""
        return self.rollout(rollout_id) + WIRE_SUFFIX

    def rollout_keys(self, rollout_id: str) -> tuple[str, str]:
        """Every key a rollout may have: its arrays and its wire parts (deleted together)."""
        return self.rollout(rollout_id), self.sample_wire(rollout_id)

    @property
    def refused_writes(self) -> str:
        """How many rollout payload writes were refused: the id was stored already (a
        claim check is written once; the original stays intact)."""
        return f"{self.prefix}rollout_writes_refused"

    @property
    def rollout_stream(self) -> str:
        """Small rollout records (ids, scalars) that producers append for the orchestrator."""
        return f"{self.prefix}rollouts"

    def step(self, step: int, name: str) -> str:
        """A step-scoped key: a `StepValue`, or (through the methods below) a stage mark,
        the stage times, the ranks sent, a per-rank payload."""
        return f"{self.steps_prefix}{step}:{name}"

    @property
    def steps_prefix(self) -> str:
        """What every step-scoped key starts with, followed by the step number."""
        return f"{self.prefix}step:"

    def done(self, step: int, stage: str, rank: int | None = None) -> str:
        """A stage's completion mark for a step (per rank for a per-rank stage)."""
        return self.step(step, f"done:{stage_field(stage, rank)}")

    def marked_ranks(self, step: int, stage: str) -> str:
        """A per-rank stage's ranks, pushed as each one's completion mark is written: what a
        task waiting for them blocks on (a send sends its step's ranks as their encodes end)."""
        return self.step(step, f"marked:{stage}")

    def times(self, step: int) -> str:
        """The step's stage seconds, field `stage_field(stage, rank)`."""
        return self.step(step, "times")

    def sent(self, step: int) -> str:
        """The ranks whose send of the step is done (the fan-in to publish)."""
        return self.step(step, "sent")

    def step_keys(self, step: int) -> str:
        """The set of every key that belongs to a step, so releasing it is one call."""
        return self.step(step, "keys")

    def payload(self, step: int, rank: int) -> str:
        return self.step(step, f"{PAYLOAD}:{rank}")

    @property
    def held_bytes(self) -> str:
        """What the run holds for its producers' budget (`max_held_bytes`), per holder: a
        rollout id (its blob and its rows files) or `payload:{step}:{rank}` (a retained
        payload and the rows files it points at) -> bytes. Each holder is counted once into
        `held_bytes_total` and taken out once, when its bytes go."""
        return f"{self.prefix}held_bytes"

    @property
    def held_bytes_total(self) -> str:
        return f"{self.prefix}held_bytes_total"

    @property
    def retained_payloads(self) -> str:
        """Steps whose per-rank payloads outlive the step's release (sorted set, score = step)
        so that a rank can replay what it has not acknowledged."""
        return f"{self.prefix}retained_payloads"

    @property
    def metrics_stream(self) -> str:
        return f"{self.prefix}metrics"

    @property
    def policy_version(self) -> str:
        return f"{self.prefix}policy_version"

    @property
    def known_policy_version(self) -> str:
        """The version the orchestrator's gate knows from its policy source, mirrored for
        producers (an external trainer may announce it outside Redis)."""
        return f"{self.prefix}known_policy_version"

    @property
    def policy_channel(self) -> str:
        return f"{self.prefix}policy"

    def trained(self, step: int) -> str:
        """Ranks that have received (trained) a step; the last one advances the policy."""
        return f"{self.trained_prefix}{step}"

    @property
    def trained_prefix(self) -> str:
        """What every `trained` set's key starts with, followed by the step number."""
        return f"{self.prefix}trained:"

    @property
    def held_patterns(self) -> tuple[str, ...]:
        """Match patterns of the keys a fully released run no longer holds: rollouts, step
        keys, retained payloads and acknowledgement sets."""
        return (self.rollout("*"), f"{self.steps_prefix}*", self.retained_payloads, f"{self.trained_prefix}*")

    def received(self, rank: int) -> str:
        """A trainer rank's log of received steps: step -> checksum."""
        return f"{self.prefix}received:{rank}"

    def rows_held(self, step: int) -> str:
        """The rollouts a step shipped with side-array rows in the run's own files: deleted
        with the step's retained payloads (`RunRows`)."""
        return f"{self.prefix}rows_held:{step}"

    def received_rows(self, rank: int) -> str:
        """A trainer rank's checksums of the side-array rows it read by handle: step -> checksum."""
        return f"{self.prefix}received_rows:{rank}"

    def deliveries(self, rank: int) -> str:
        """How many times each step reached a rank's trainer (exactly once, or a bug)."""
        return f"{self.prefix}deliveries:{rank}"

    def delivery_order(self, rank: int) -> str:
        """The steps a rank's trainer received, in the order it received them (a list)."""
        return f"{self.prefix}delivery_order:{rank}"

    def last_sent(self, rank: int) -> str:
        """The newest step whose message has left the sending process for `rank`."""
        return f"{self.prefix}last_sent:{rank}"

    def sending(self, rank: int) -> str:
        """The step a sender is about to send to `rank` (an intent mark, written before the
        send): found above `last_sent` by the next sender, the previous one died mid-send."""
        return f"{self.prefix}sending:{rank}"

    @property
    def announced_ranks(self) -> str:
        """Ranks that have announced READY to any of the run's senders (a set, with an
        expiry): a replacement sender knows them without hearing READY again."""
        return f"{self.prefix}announced_ranks"

    @property
    def rank_contact(self) -> str:
        """Each trainer rank's last contact (a hash, `transport.rank_contact`): when, how, the
        address it was seen at, the last step sent to it and the last it decoded."""
        return f"{self.prefix}rank_contact"

    def run_key(self, name: str) -> str:
        """A run-wide key; the ones rlship uses are the properties below."""
        return f"{self.prefix}{name}"

    # Producer admission: the backlog is produced - accounted.

    @property
    def produced(self) -> str:
        """Rollouts written by producers (a counter)."""
        return self.run_key("produced")

    @property
    def accounted(self) -> str:
        """Rollouts the orchestrator has rejected, discarded or cut (a counter)."""
        return self.run_key("accounted")

    # The orchestrator's bookkeeping.

    @property
    def next_step(self) -> str:
        return self.run_key("next_step")

    @property
    def status(self) -> str:
        """The orchestrator's live counters (pending, open groups, lag), for progress displays."""
        return self.run_key("status")

    @property
    def info(self) -> str:
        """The run's shape (steps, ranks, queues), written by its orchestrator for `rlship status`."""
        return self.run_key("info")

    @property
    def settings(self) -> str:
        """The run's settings (orchestrator.resume): what a resumed run starts from."""
        return self.run_key("settings")

    @property
    def checkpoint(self) -> str:
        """The orchestrator's restart point (orchestrator.checkpoint)."""
        return self.run_key("checkpoint")

    @property
    def followed(self) -> str:
        """The newest step whose record the orchestrator has mirrored and released."""
        return self.run_key("followed")

    @property
    def orchestrator_lease(self) -> str:
        """Held by the one live orchestrator of the run."""
        return self.run_key("orchestrator_lease")

    @property
    def run_marker(self) -> str:
        """Written once when the run starts; its absence means Redis lost the run."""
        return self.run_key(RUN_MARKER)

    @property
    def alive(self) -> str:
        """Set while an orchestrator of the run lives (with an expiry, so a killed run's ends
        too): a task of a run without it is dropped, counted in `tasks_dropped`."""
        return self.run_key("alive")

    @property
    def own_queue_traces(self) -> list[str]:
        """The keys of the run's own Celery queues (`run_queue`): given the run's expiry with
        its other keys, so a killed run's queues go too (kombu gives its binding tables none)."""
        return [key for kind in RUN_QUEUE_KINDS for key in queue_traces(run_queue(self.run_id, kind))]

    @property
    def outcomes(self) -> str:
        """What became of each recent rollout (transport.outcomes): cut into a step, dropped
        at the cut and why, discarded or rejected; a hash, bounded by `outcome_order`."""
        return self.run_key("outcomes")

    @property
    def outcome_order(self) -> str:
        """The rollout ids of `outcomes`, oldest first: the oldest leave past the run's horizon."""
        return self.run_key("outcome_order")

    @property
    def outcome_counts(self) -> str:
        """How many rollouts had each outcome (`{kind}/{reason}`), each counted once."""
        return self.run_key("outcome_counts")

    @property
    def finished(self) -> str:
        """Set when the run shipped all its steps: its id is not reused."""
        return self.run_key("finished")

    def trace(self, step: int) -> str:
        """The W3C `traceparent` of the step's root span (`tasks.tracing`): the step's trace
        id in one read. Outside the step's keys, so it outlives the step's release."""
        return self.run_key(f"trace:{step}")

    @property
    def spans(self) -> str:
        """The run's finished spans on their way to the OTLP collector: each entry one task's
        spans as an OTLP `ExportTraceServiceRequest`, handed on by the pool process that ran
        it on its next stage task's first read (`tasks.task_spans`), oldest first, relayed by the orchestrator
        (`orchestrator.span_relay`); at most `tasks.tracing.SPANS_HELD_MAX` entries."""
        return self.run_key("spans")

    @property
    def spans_dropped(self) -> str:
        """How many entries of `spans` were dropped: the oldest past its cap, or a batch the
        collector refused for good."""
        return self.run_key("spans_dropped")

    # The tasks' bookkeeping.

    @property
    def published(self) -> str:
        return self.run_key("published")

    @property
    def released(self) -> str:
        return self.run_key("released")

    @property
    def totals(self) -> str:
        return self.run_key("totals")

    @property
    def sent_checksums(self) -> str:
        return self.run_key("sent_checksums")

    @property
    def sent_rows_checksums(self) -> str:
        """`{step}:{rank}` -> the checksum of the side-array rows the rank's payload points at."""
        return self.run_key("sent_rows_checksums")

    @property
    def stage_calls(self) -> str:
        return self.run_key("stage_calls")

    @property
    def redundant(self) -> str:
        """Per stage, the deliveries that came after their step was done (redeliveries,
        re-enqueues by the stall watchdog or a restarted orchestrator): skipped quietly."""
        return self.run_key("redundant_deliveries")

    @property
    def served_by(self) -> str:
        """Per Celery worker (its node name, `cpu-{run_id}@host`), the run's tasks it took."""
        return self.run_key("served_by")

    @property
    def queue_wait(self) -> str:
        """The run's tasks' waits in their queue, from enqueue (or a retry's due time) to
        start, as histogram buckets per queue kind (`transport.task_metrics`)."""
        return self.run_key("queue_wait")

    @property
    def task_failures(self) -> str:
        """Per stage, deliveries that raised or were redelivered after their worker was lost."""
        return self.run_key("task_failures")

    @property
    def stage_seconds(self) -> str:
        """`{step}:{stage}` -> seconds a stage of the step computed (and `{step}:ship`), for
        the orchestrator's stage histograms: outlives the step's keys until it reads them."""
        return self.run_key("stage_seconds")

    @property
    def trainer_idle(self) -> str:
        """Per rank, seconds rlship's trainer rank waited with no step to take (a counter)."""
        return self.run_key("trainer_idle")

    @property
    def rollout_flow(self) -> str:
        """Rollouts leaving the byte budget (`released`) and the bytes in and out of it
        (`produced_bytes`, `released_bytes`); rollouts in are `produced`."""
        return self.run_key("rollout_flow")

    @property
    def tasks_dropped(self) -> str:
        return self.run_key("tasks_dropped")

    @property
    def evicted(self) -> str:
        return self.run_key("payloads_evicted_unacknowledged")

    @property
    def interrupted_sends(self) -> str:
        """Sends that found an earlier process's `sending` mark above `last_sent`."""
        return self.run_key("interrupted_sends")

    @property
    def foreign_dropped(self) -> str:
        """Per rank, how many steps of another run reached rlship's trainer for the rank and
        were dropped (it is pointed at another run's port or directory)."""
        return self.run_key("foreign_dropped")

    @property
    def replication_probe(self) -> str:
        """Written just before a WAIT that confirms a write reached the replicas
        (`transport.replication`); expires after an hour."""
        return self.run_key("replication_probe")

    @property
    def ship_fatal(self) -> str:
        """Why the run cannot go on (a ZMQ port pair the ship worker could not bind within
        `bind_wait_seconds`, an output directory of another run, a disk a worker or producer
        writes that is full): read by the orchestrator every second, which then stops the run
        naming it."""
        return self.run_key("ship_fatal")

    @property
    def ship_problem(self) -> str:
        """Why the ship worker cannot send (a port it cannot bind, a rank not announced): read
        by the orchestrator when a step makes no progress; short-lived, cleared by a send."""
        return self.run_key("ship_problem")

    @property
    def self_expiring(self) -> frozenset[str]:
        """Keys written each time with a short expiry of their own (a lease, a liveness mark, a
        passing problem, a probe): renewing the run's keys leaves them to it."""
        return frozenset({self.orchestrator_lease, self.alive, self.ship_problem, self.replication_probe})

    @property
    def faults(self) -> str:
        """Armed faults (tests, `rlship chaos`), read by workers started with RLSHIP_FAULTS=1."""
        return self.run_key("faults")


# Claims of ZMQ port pairs (transport.port_claims): a key per port, across the runs of a
# Redis, so under a prefix no run's keys can have (a run id has no `:`).
PORT_CLAIM_PREFIX = "rlship::port:"


def ship_port_claim(host: str, port: int) -> str:
    """The claim of `host:port`: the id of the live run whose ship worker binds it."""
    return f"{PORT_CLAIM_PREFIX}{host}:{port}"


def ship_port_claim_pattern() -> str:
    """Matches every port claim of the server (`rlship doctor`)."""
    return f"{PORT_CLAIM_PREFIX}*"


def ship_port_of_claim(key: str) -> tuple[str, int]:
    """(host, port) of a claim's key."""
    host, _, port = key.removeprefix(PORT_CLAIM_PREFIX).rpartition(":")
    return host, int(port)


PAYLOAD = "payload"  # a per-rank payload is `step:{n}:payload:{rank}` (the release script too)


RUN_QUEUE_KINDS = ("cpu", "ship")


def run_queue(run_id: str, kind: str) -> str:
    """A run's own Celery queue of `kind` (cpu, ship), a Redis list of that name: runs on one
    Redis never share one unless an operator names it."""
    return f"rlship.{run_id}.{kind}"


def queue_traces(queue: str) -> tuple[str, str, str]:
    """The keys a Celery queue is on Redis: its list and kombu's two binding tables of it."""
    return queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"


def is_run_queue(queue: str) -> bool:
    """Whether `queue` is some run's own (`run_queue`), not one an operator named."""
    prefix, _, kind = queue.rpartition(".")
    return prefix.startswith("rlship.") and kind in RUN_QUEUE_KINDS


def run_markers_pattern() -> str:
    """Matches the start marker of every run on the server (`rlship status`)."""
    return f"{RUN_PREFIX}*:{RUN_MARKER}"


def run_id_of_marker(key: str) -> str:
    """The run id in a key `run_markers_pattern` matched."""
    return key.removeprefix(RUN_PREFIX).removesuffix(f":{RUN_MARKER}")


def stage_field(stage: str, rank: int | None = None) -> str:
    """A stage's name in a step's marks and times: `{stage}`, or `{stage}:{rank}` per rank."""
    return stage if rank is None else f"{stage}:{rank}"


def stage_of_field(field: str) -> str:
    """The stage a `stage_field` names."""
    return field.split(":")[0]
