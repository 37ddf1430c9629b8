"""Episode producers: a whole group of verifiers episodes a call, through rlship's rollout
producers (same admission, same checks, same refusals: orchestrator.producer).

A call takes one rollout group of episodes (one `group.id`, one env) as prime-rl's train
sink takes a group when it completes: its rollouts are one per trainable branch, and one
record of no tokens for each trace that trains nothing (errored, of an agent that does not
train, or with nothing left to train: rlship.verifiers.conversion), written together as
one rlship group whose size is theirs (`group_rollouts`); the orchestrator discards the
latter (`error`, `zero_advantage`) and counts them in the step's `all` statistics, as
prime-rl 559b447 counts every trace of its window. The rollouts' credit is the episodes'
own per-token advantages where the user's algorithm assigned any, else prime-rl's plain
GRPO over the group's trainable traces; either way it ships as given (rlship computes no
baseline for it). With a run whose wire takes side arrays by handle, routed experts go to
the run's rows files (the producer writes them) instead of Redis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self

import redis
import redis.asyncio as aioredis
import verifiers.v1 as vf

from orchestrator.groups import group_size_of
from orchestrator.producer import AsyncRolloutProducer, RolloutProducer
from orchestrator.records import RecordRejected, RolloutRecord
from orchestrator.rollout_checks import RolloutRejected
from orchestrator.settings import RunSettings
from rlship.verifiers.conversion import (
    ActionLoss,
    Conversion,
    GroupRollouts,
    convert_group,
    decode_episode,
)
from transport.payload_segments import PAYLOAD_FIELD, rollout_rows_path, write_segment_file

BY_HANDLE = ("routed_experts",)  # the side arrays an episode has that may travel by handle


class _EpisodeConverter:
    """What both episode producers share: a group's checks and conversion."""

    rollouts: RolloutProducer | AsyncRolloutProducer

    def __init__(
        self,
        rollouts: RolloutProducer | AsyncRolloutProducer,
        temperature: float = 1.0,
        action_loss: ActionLoss = "rl",
        mm_token_type_ids_mapping: Mapping[int, int] | None = None,
        policy_version: int | None = None,
    ) -> None:
        self.rollouts = rollouts
        self.temperature = temperature
        self.action_loss: ActionLoss = action_loss
        self.mm_token_type_ids_mapping = mm_token_type_ids_mapping
        self.policy_version = policy_version
        # Traces that trained nothing so far, by why (prime-rl's train sink counts the errored).
        self.errored_traces = 0
        self.not_trainable_traces = 0
        self.untrained_traces = 0

    def _group(self, episodes: Sequence[vf.Episode | bytes]) -> GroupRollouts:
        """The group's rollouts, checked and as the rollout producer is to write them (sized,
        side arrays by handle where the run takes them), or RolloutRejected naming every bad
        episode, trace and branch."""
        decoded = [decode_episode(episode) for episode in episodes]
        self._check_group(decoded)
        conversion = Conversion(
            self.rollouts.keys.run_id,
            self.policy_version,
            self.temperature,
            self.action_loss,
            self.mm_token_type_ids_mapping,
            whole_group=True,
        )
        group = convert_group(decoded, conversion, grpo=True)
        self.errored_traces += group.errored_traces
        self.not_trainable_traces += group.not_trainable_traces
        self.untrained_traces += group.untrained_traces
        group.rollouts = [(record, self._by_handle(record, arrays)) for record, arrays in group.rollouts]
        return group

    def _check_group(self, episodes: Sequence[vf.Episode]) -> None:
        """A call is one whole group: one group id, one env, as many episodes as the run's
        group_size (a run not known: any number)."""
        if not episodes:
            raise RolloutRejected({"<call>": "no episodes: a call writes one whole group of episodes"})
        groups = {episode.group.id if episode.group else None for episode in episodes}
        envs = {episode.env.name for episode in episodes}
        problems = {}
        first = episodes[0]
        if len(groups) > 1:
            problems[first.id] = (
                f"episode {first.id!r}: group: the call holds groups {sorted(map(str, groups))}; "
                "one group a call"
            )
        elif len(envs) > 1:
            problems[first.id] = (
                f"episode {first.id!r}: env.name: the call holds envs {sorted(map(str, envs))}; "
                "one env a group"
            )
        if problems:
            raise RolloutRejected(problems)
        run = self.rollouts.settings
        if run is None:
            return
        try:
            size = group_size_of(run.group_size, str(envs.pop()))
        except RecordRejected as exc:
            raise RolloutRejected({first.id: f"episode {first.id!r}: {exc}"}) from None
        if len(episodes) != size:
            raise RolloutRejected(
                {
                    first.id: f"episode {first.id!r}: group: {groups.pop()!r} has {len(episodes)} episodes; "
                    f"the run's group_size for its env is {size} (a call writes one whole group)"
                }
            )

    def _by_handle(self, record: RolloutRecord, arrays: dict[str, Any]) -> dict[str, Any]:
        """With a run whose wire takes side arrays by handle, the rollout's routed experts
        written to its rows file and passed as segments; else as they are."""
        run = self.rollouts.settings
        moved = {name: arrays[name] for name in BY_HANDLE if name in arrays}
        if run is None or not moved or run.ship_config().side_arrays.refused_by is not None:
            return arrays
        path = rollout_rows_path(run.payload_root, run.run_id, record.rollout_id)
        kept = {name: value for name, value in arrays.items() if name not in moved}
        return kept | {PAYLOAD_FIELD: write_segment_file(path, moved)}


class EpisodeProducer(_EpisodeConverter):
    """Groups of verifiers episodes into a run, on a `RolloutProducer`."""

    rollouts: RolloutProducer

    @classmethod
    def for_run(
        cls,
        client: redis.Redis,
        run: str | RunSettings,
        admitted: bool = True,
        wait: float = 0.0,
        **conversion: Any,
    ) -> Self:
        """An episode producer for run `run` (`RolloutProducer.for_run` says how); the
        keyword arguments are the conversion's (`temperature`: the env's sampling
        temperature; `action_loss`: `rl`, `ce` or `ref_kl`; `mm_token_type_ids_mapping`;
        `policy_version` for episodes without a policy span)."""
        return cls(RolloutProducer.for_run(client, run, admitted, wait), **conversion)

    def produce(self, episodes: Sequence[vf.Episode | bytes], timeout: float | None = None) -> GroupRollouts:
        """Write one whole group of episodes (or their msgpack bytes); returns what it became.
        Raises as `RolloutProducer.produce` does: RolloutRejected (naming each bad episode,
        trace and branch; nothing written) or AdmissionRefused."""
        group = self._group(episodes)
        if written := group.written:
            self.rollouts.produce(written, timeout=timeout)
        return group


class AsyncEpisodeProducer(_EpisodeConverter):
    """The same on an `AsyncRolloutProducer`, for producers on an event loop."""

    rollouts: AsyncRolloutProducer

    @classmethod
    def for_run(
        cls,
        client: aioredis.Redis,
        run: str | RunSettings,
        admitted: bool = True,
        wait: float = 0.0,
        **conversion: Any,
    ) -> Self:
        """See `EpisodeProducer.for_run`; the run's settings are read on the first call."""
        return cls(AsyncRolloutProducer.for_run(client, run, admitted, wait), **conversion)

    async def produce(
        self, episodes: Sequence[vf.Episode | bytes], timeout: float | None = None
    ) -> GroupRollouts:
        """See `EpisodeProducer.produce`."""
        await self.rollouts.ready()
        group = self._group(episodes)
        if written := group.written:
            await self.rollouts.produce(written, timeout=timeout)
        return group
