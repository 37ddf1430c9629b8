"""Producers: how rollouts enter rlship.

A producer stores a rollout's arrays under its key and appends the small record to the
rollout stream, in one round trip (`RolloutProducer`, `AsyncRolloutProducer`); an id that is
stored already is refused, counted, and its record not appended.
`SyntheticWorkload` makes realistic, seeded rollouts for local runs, tests and benchmarks:
several envs, long-tailed lengths, multi-turn masks, binary and fractional rewards with
per-task difficulty (so some groups have zero advantage), errors and truncations.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np
import redis
import redis.asyncio as aioredis

from orchestrator.checks import preflight_client
from orchestrator.records import RolloutRecord
from orchestrator.settings import RunSettings, add_settings_arguments, settings_from_args
from tasks.stages.finalize import check_rollout_arrays
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.schema import EncodedTensor, SchemaError
from transport.store import DEFAULT_TTL_SECONDS, flat_arrays, pack_arrays

Rollouts = list[tuple[RolloutRecord, Mapping[str, np.ndarray]]]


class RolloutRejected(ValueError):
    """Rollouts that were not written, each with why (naming the field and the value)."""

    def __init__(self, problems: dict[str, str]) -> None:
        super().__init__("; ".join(f"rollout {rid!r}: {problem}" for rid, problem in problems.items()))
        self.problems = problems


def check_rollouts(
    rollouts: Rollouts, max_tokens: int, vocab_size: int
) -> None:
    """The workers' own payload checks, run where the bad data is made (the producer), and
    one id given twice in the same call."""
    problems = {}
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
        problem = check_rollout_arrays(
            {k: v if isinstance(v, EncodedTensor) else np.asarray(v) for k, v in flat.items()},
            record.num_tokens,
            max_tokens,
            vocab_size,
        )
        if problem is not None:
            problems[record.rollout_id] = problem
    if problems:
        raise RolloutRejected(problems)


# KEYS: the rollout stream, the produced counter, the refused-writes counter, then one payload
# key per rollout. ARGV: the TTL, then per rollout its arrays blob and its record. A payload
# is written only if its key is new (a claim check is written once), and only then is its
# record appended: a duplicate id can neither replace the original's arrays nor reach the
# orchestrator. Returns the 1-based positions of the refused rollouts.
_PRODUCE_LUA = """
local refused = {}
for i = 4, #KEYS do
  local at = 2 + (i - 4) * 2
  if redis.call('SET', KEYS[i], ARGV[at], 'NX', 'EX', ARGV[1]) then
    redis.call('XADD', KEYS[1], '*', 'record', ARGV[at + 1])
    redis.call('INCR', KEYS[2])
  else
    redis.call('INCR', KEYS[3])
    table.insert(refused, i - 3)
  end
end
return refused
"""

DEFAULT_LIMITS = RunSettings()
log = logging.getLogger("rlship.producer")


class _Producer:
    """What both producer APIs share. Records are validated by their pydantic model; arrays
    by the workers' checks against the run's limits (`max_tokens` as its `seq_len`, and its
    vocabulary; by default those of a run with default settings), so a bad rollout fails
    where it is made, naming its field and value."""

    def __init__(
        self,
        client: redis.Redis | aioredis.Redis,
        run_id: str,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        max_tokens: int = DEFAULT_LIMITS.seq_len,
        vocab_size: int = DEFAULT_LIMITS.vocab_size,
    ) -> None:
        self.client = client
        self.keys = RunKeys(run_id)
        self.ttl = ttl_seconds
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self._produce = client.register_script(_PRODUCE_LUA)

    @classmethod
    def for_run(cls, client: Any, settings: RunSettings) -> Self:
        """A producer checking rollouts against the run's `seq_len` and vocabulary."""
        return cls(client, settings.run_id, max_tokens=settings.seq_len, vocab_size=settings.vocab_size)

    def _script_arguments(self, rollouts: Rollouts) -> tuple[list[str], list[Any]]:
        """Check every rollout (RolloutRejected, nothing written, if any is bad), then the
        script's keys and arguments: arrays before records, so a record never points at a
        payload not there yet."""
        check_rollouts(rollouts, self.max_tokens, self.vocab_size)
        keys = [self.keys.rollout_stream, self.keys.run_key("produced"), self.keys.refused_writes]
        args: list[Any] = [self.ttl]
        for record, arrays in rollouts:
            keys.append(self.keys.rollout(record.rollout_id))
            args += [pack_arrays(arrays), record.model_dump_json()]
        return keys, args

    @staticmethod
    def _raise_refused(rollouts: Rollouts, refused: list[int]) -> None:
        problem = (
            "rollout_id: already stored for this run; the original is kept and this write was "
            "refused (the others of the call were written)"
        )
        if refused:
            raise RolloutRejected({rollouts[position - 1][0].rollout_id: problem for position in refused})


class RolloutProducer(_Producer):
    """Synchronous producer API (for inference/env workers)."""

    client: redis.Redis

    def produce(self, rollouts: Rollouts) -> None:
        keys, args = self._script_arguments(rollouts)
        self._raise_refused(rollouts, self._produce(keys=keys, args=args))

    def outstanding(self) -> int:
        """Rollouts appended but not yet accounted for by the orchestrator (shipped or discarded)."""
        produced, accounted = self.client.mget(self.keys.run_key("produced"), self.keys.run_key("accounted"))
        return int(produced or 0) - int(accounted or 0)


class AsyncRolloutProducer(_Producer):
    """The same on `redis.asyncio`, for producers that live on an event loop."""

    client: aioredis.Redis

    async def produce(self, rollouts: Rollouts) -> None:
        keys, args = self._script_arguments(rollouts)
        self._raise_refused(rollouts, await self._produce(keys=keys, args=args))


@dataclass
class SyntheticWorkload:
    """Seeded synthetic rollouts, one group at a time."""

    seed: int = 0
    group_size: int = 8
    seq_len: int = 2048
    vocab_size: int = 151_936
    envs: tuple[str, ...] = ("math", "code", "chat")
    error_rate: float = 0.02
    cancel_rate: float = 0.01
    policy_version: int = 0
    routed_experts: bool = False
    _rng: np.random.Generator = field(init=False, repr=False)
    _groups: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def _lengths(self) -> tuple[int, int]:
        rng = self._rng
        prompt = int(np.clip(rng.lognormal(4.5, 0.6), 8, self.seq_len // 4))
        completion = int(np.clip(rng.lognormal(5.5, 1.0), 1, self.seq_len - prompt))
        return prompt, completion

    def _arrays(self, prompt: int, completion: int, turns: int) -> dict[str, np.ndarray]:
        rng = self._rng
        total = prompt + completion
        ids = np.minimum(rng.zipf(1.3, total), self.vocab_size - 1).astype(np.int32)
        mask = np.zeros(total, dtype=bool)
        mask[prompt:] = True
        if turns > 1 and completion >= 2 * turns:
            # Environment responses between assistant turns are context, not trained on.
            cuts = prompt + np.sort(rng.choice(np.arange(1, completion), size=2 * (turns - 1), replace=False))
            for start, stop in zip(cuts[0::2], cuts[1::2], strict=True):
                mask[start:stop] = False
        logprobs = np.where(mask, -rng.exponential(0.7, total), 0.0).astype(np.float32)
        arrays = {"input_ids": ids, "loss_mask": mask, "inference_logprobs": logprobs}
        if self.routed_experts:
            arrays["routed_experts"] = rng.integers(0, 64, size=(total, 2, 4), dtype=np.uint8)
        return arrays

    def group(self) -> list[tuple[RolloutRecord, dict[str, np.ndarray]]]:
        """One group: `group_size` rollouts of one task of one env."""
        rng = self._rng
        index = self._groups
        self._groups += 1
        env = self.envs[index % len(self.envs)]
        difficulty = float(rng.beta(0.6, 0.6))  # near 0 or 1 often: many zero-advantage groups
        fractional = env == "chat"
        out = []
        for member in range(self.group_size):
            prompt, completion = self._lengths()
            turns = int(rng.integers(1, 4)) if env == "code" else 1
            error = "timeout" if rng.random() < self.error_rate else None
            cancelled = error is None and rng.random() < self.cancel_rate
            truncated = prompt + completion >= self.seq_len - 1
            reward = float(rng.random() < difficulty) if not fractional else round(float(rng.beta(2, 5)), 3)
            record = RolloutRecord(
                rollout_id=f"s{self.seed}-g{index}-r{member}",
                group_id=f"g{index}",
                task_id=f"{env}-task{index % 97}",
                env=env,
                policy_version=self.policy_version,
                reward=0.0 if error else reward,
                num_input_tokens=prompt,
                num_output_tokens=completion,
                num_turns=turns,
                temperature=1.0,
                is_truncated=truncated,
                error=error,
                cancelled=cancelled,
                stop_condition="length" if truncated else "stop",
                metrics={"solve_time": float(rng.exponential(2.0))} if env == "math" else {},
            )
            out.append((record, self._arrays(prompt, completion, turns)))
        return out

    def groups(self) -> Iterator[list[tuple[RolloutRecord, dict[str, np.ndarray]]]]:
        while True:
            yield self.group()


def run_producer(
    settings: RunSettings,
    groups: int | None = None,
    stop: threading.Event | None = None,
    poll_seconds: float = 0.02,
) -> int:
    """Produce groups until `groups` are written or `stop` is set (or forever), staying
    within the orchestrator's outstanding-rollout limit and following the policy version."""
    client = connect_redis(settings.redis_url)
    producer = RolloutProducer.for_run(client, settings)
    workload = SyntheticWorkload(
        seed=settings.seed,
        group_size=settings.group_size,
        seq_len=settings.seq_len,
        vocab_size=settings.vocab_size,
    )
    # A resumed run: the groups its earlier start wrote are made again (same seed) and skipped.
    for _ in range(int(client.get(producer.keys.run_key("produced")) or 0) // settings.group_size):
        workload.group()
    written = 0
    while (groups is None or written < groups) and not (stop is not None and stop.is_set()):
        if producer.outstanding() + settings.group_size > settings.outstanding_limit:
            time.sleep(poll_seconds)
            continue
        workload.policy_version = int(client.get(producer.keys.policy_version) or 0)
        try:
            producer.produce(workload.group())
        except RolloutRejected as exc:
            log.warning("%s", exc)
        written += 1
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument("--groups", type=int, default=None, help="stop after this many groups")


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    preflight_client("produce", settings).close()
    run_producer(settings, groups=args.groups)
    return 0
