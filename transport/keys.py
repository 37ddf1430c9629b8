"""Redis key names. Every key of a run lives under `rlship:{run_id}:` so runs can share a
server and one run can never name (or delete) another run's keys."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunKeys:
    run_id: str

    def __post_init__(self) -> None:
        if not self.run_id or any(c in self.run_id for c in ":*?[] \n"):
            raise ValueError(f"run_id: {self.run_id!r} must be non-empty, without ':', spaces or globs")

    @property
    def prefix(self) -> str:
        return f"rlship:{self.run_id}:"

    def rollout(self, rollout_id: str) -> str:
        """A rollout's arrays, written by its producer."""
        return f"{self.prefix}rollout:{rollout_id}"

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
        """A step-scoped key: manifest, plan, stage marks, per-rank payloads."""
        return f"{self.prefix}step:{step}:{name}"

    def step_keys(self, step: int) -> str:
        """The set of every key that belongs to a step, so releasing it is one call."""
        return self.step(step, "keys")

    def payload(self, step: int, rank: int) -> str:
        return self.step(step, f"payload:{rank}")

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
        return f"{self.prefix}trained:{step}"

    def received(self, rank: int) -> str:
        """A trainer rank's log of received steps: step -> checksum."""
        return f"{self.prefix}received:{rank}"

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

    def run_key(self, name: str) -> str:
        """Run-wide bookkeeping (next step, counters, stage calls)."""
        return f"{self.prefix}{name}"
