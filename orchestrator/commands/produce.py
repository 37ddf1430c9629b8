"""`rlship produce`: the synthetic rollout producer of local runs, tests and benchmarks.

`SyntheticWorkload` makes realistic, seeded rollouts: several envs, long-tailed lengths,
multi-turn masks, binary and fractional rewards with per-task difficulty (so some groups
have zero advantage), errors and truncations. `run_producer` writes them through a
`RolloutProducer` as the run admits them, stamped with the trainers' policy version.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.admission import FINISHED, AdmissionRefused
from orchestrator.commands.checks import preflight_client
from orchestrator.groups import group_size_of
from orchestrator.lease import ALIVE_SECONDS
from orchestrator.logs import configure_logging
from orchestrator.producer import RolloutProducer, RolloutRejected
from orchestrator.records import RolloutRecord
from orchestrator.settings import RunSettings
from orchestrator.settings_resolution import add_settings_arguments, settings_from_args
from orchestrator.stored_settings import RunNotStarted, SettingsDisagree
from transport.connection import connect_redis
from transport.keys import RunKeys
from transport.outcomes import UNKNOWN
from transport.payload_segments import PAYLOAD_FIELD, rollout_rows_path, write_segment_file
from transport.run_files import DiskFull, restrict
from transport.store import PayloadStore

WAIT_REPORT_SECONDS = 5.0  # how often a waiting producer says why
NEEDS_VERIFIERS = "needs the verifiers extra (pip install -e '.[verifiers]')"
# The moe workload's routed experts: Qwen3-30B-A3B's 48 layers, top-8 of 128 experts, one
# uint8 expert id per layer and slot: 384 bytes a token.
MOE_LAYERS, MOE_TOPK, MOE_EXPERTS = 48, 8, 128
log = logging.getLogger("rlship.producer")
DEFAULT_ENVS = ("math", "code", "chat")


def workload_envs(settings: RunSettings) -> tuple[str, ...]:
    """The envs a synthetic workload draws from: the run's own (`envs`), else those its
    per-env group sizes name, else the default three. Any other would be refused by the run."""
    if settings.envs:
        return tuple(settings.envs)
    if isinstance(settings.group_size, Mapping):
        return tuple(settings.group_size)
    return DEFAULT_ENVS


@dataclass
class SyntheticWorkload:
    """Seeded synthetic rollouts, one group at a time."""

    seed: int = 0
    group_size: int | Mapping[str, int] = 8  # the run's, or its envs' (then its envs)
    seq_len: int = 2048
    vocab_size: int = 151_936
    envs: tuple[str, ...] = DEFAULT_ENVS
    error_rate: float = 0.02
    cancel_rate: float = 0.01
    policy_version: int = 0
    routed_experts: bool = False
    # moe: routed experts of a 48-layer top-8 model, written to a file per rollout in
    # `{payload_root}/{run_id}/` and passed by handle (or inline, if `moe_inline`).
    moe_rows: tuple[Path, str] | None = None
    moe_inline: bool = False
    _rng: np.random.Generator = field(init=False, repr=False)
    _groups: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    @classmethod
    def for_run(cls, settings: RunSettings) -> SyntheticWorkload:
        """The run's workload (`workload`): dense, or with routed experts by handle or inline."""
        moe_rows = (Path(str(settings.payload_root)), settings.run_id) if settings.workload == "moe" else None
        return cls(
            seed=settings.seed,
            group_size=settings.group_size,
            envs=workload_envs(settings),
            seq_len=settings.seq_len,
            vocab_size=settings.vocab_size,
            moe_rows=moe_rows,
            moe_inline=settings.workload == "moe-inline",
        )

    def lengths(self) -> tuple[int, int]:
        """A rollout's prompt and completion lengths: long-tailed, within `seq_len`."""
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

    def _moe_experts(self, total: int) -> np.ndarray:
        return self._rng.integers(0, MOE_EXPERTS, size=(total, MOE_LAYERS, MOE_TOPK), dtype=np.uint8)

    def _with_moe(self, rollout_id: str, arrays: dict[str, Any], write: bool) -> dict[str, Any]:
        """The rollout's routed experts: inline, or in its own file under the payload root."""
        experts = self._moe_experts(len(arrays["input_ids"]))
        if self.moe_inline or not write:
            return arrays | {"routed_experts": experts}
        assert self.moe_rows is not None
        path = rollout_rows_path(*self.moe_rows, rollout_id)
        return arrays | {PAYLOAD_FIELD: write_segment_file(path, {"routed_experts": experts})}

    def group(self, write: bool = True) -> list[tuple[RolloutRecord, dict[str, Any]]]:
        """One group: its env's `group_size` rollouts of one task (`write` False: made only to
        be skipped, so no file of side-array rows is written)."""
        rng = self._rng
        index = self._groups
        self._groups += 1
        env = self.envs[index % len(self.envs)]
        difficulty = float(rng.beta(0.6, 0.6))  # near 0 or 1 often: many zero-advantage groups
        fractional = env == "chat"
        out = []
        for member in range(group_size_of(self.group_size, env)):
            prompt, completion = self.lengths()
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
            arrays = self._arrays(prompt, completion, turns)
            if self.moe_rows is not None or self.moe_inline:
                arrays = self._with_moe(record.rollout_id, arrays, write)
            out.append((record, arrays))
        return out

    def groups(self) -> Iterator[list[tuple[RolloutRecord, dict[str, Any]]]]:
        while True:
            yield self.group()


def run_producer(
    settings: RunSettings,
    groups: int | None = None,
    stop: threading.Event | None = None,
    poll_seconds: float = 0.5,
) -> int:
    """Produce groups until `groups` are written or `stop` is set (or forever), each as the
    run admits it, stamped with the trainers' policy version at the time. While the run
    refuses (backlog, gate held), wait, saying why every few seconds; a group the run can
    never take is skipped with a warning."""
    client = connect_redis(settings.redis_url)
    producer = RolloutProducer.for_run(client, settings)
    workload = SyntheticWorkload.for_run(settings)
    # A resumed run: the groups its earlier start wrote are made again (same seed) and skipped.
    skipped, produced = 0, int(client.get(producer.keys.produced) or 0)
    while skipped < produced:
        skipped += len(workload.group(write=False))
    stopped = stop.is_set if stop is not None else lambda: False
    rows = settings.run_rows()
    written = 0
    reported = 0.0
    while (groups is None or written < groups) and not stopped():
        group = workload.group()
        taken = False
        while not stopped():
            version = producer.policy_version()
            stamped = [(r.model_copy(update={"policy_version": version}), a) for r, a in group]
            try:
                producer.produce(stamped, timeout=poll_seconds)
            except AdmissionRefused as exc:
                if exc.passes:
                    if time.monotonic() - reported >= WAIT_REPORT_SECONDS:
                        log.warning("producer waits: %s", exc)
                        reported = time.monotonic()
                    continue
                if exc.reason == FINISHED:
                    log.info("run %s has finished; the producer stops", settings.run_id)
                    rows.unlink(record.rollout_id for record, _ in group)
                    return written
                log.warning("%s; group skipped", exc)
                break
            except RolloutRejected as exc:
                log.warning("%s", exc)
                # Refused by its checks, nothing of the call was written (a file the run's end
                # removed while the group was being made, say); refused as duplicates, the
                # others were. The files of those the run does not know are nobody's.
                ids = [record.rollout_id for record, _ in group]
                rows.unlink(rid for rid, outcome in producer.outcome(ids).items() if outcome.state == UNKNOWN)
            taken = True
            break
        if not taken:
            # Its rows files were written before the run refused it (or the producer stopped):
            # no key points at them, so nothing else would ever delete them.
            rows.unlink(record.rollout_id for record, _ in group)
        written += 1
    return written


def stop_the_run(settings: RunSettings, problem: str) -> None:
    """A producer that cannot write stops its run: it states why where the orchestrator looks
    (again and again: an orchestrator that starts meanwhile clears an earlier start's reason)
    until the run has ended, its alive mark gone (`rlship run` removes it once its orchestrator
    has exited), so that `rlship run` reports the run's stop, not a producer's exit."""
    client = connect_redis(settings.redis_url)
    store, alive = PayloadStore(client, settings.run_id), RunKeys(settings.run_id).alive
    lived = False
    deadline = time.monotonic() + 2 * ALIVE_SECONDS
    while time.monotonic() < deadline:
        store.stop_run(problem)
        if client.exists(alive):
            lived = True
        elif lived:
            return
        time.sleep(0.2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument("--groups", type=int, default=None, help="stop after this many groups")
    parser.add_argument(
        "--episodes",
        type=Path,
        default=None,
        metavar="PATH",
        help="write these verifiers episodes instead of synthetic rollouts: a file of msgpack episodes "
        "as environment servers return them, or a directory of *.msgpack files (needs the verifiers extra)",
    )


def produce_episodes(settings: RunSettings, path: Path) -> int:
    """`--episodes`: the files' whole groups of episodes into the run (rlship.verifiers.produce);
    0 if every one was written, 1 (each named) if not, 2 without the verifiers extra."""
    try:
        from rlship.verifiers.produce import EpisodeFileError, produce_episode_files
    except ImportError as exc:
        print(f"rlship produce: --episodes {NEEDS_VERIFIERS}: {exc}", file=sys.stderr)
        return 2
    try:
        written, problems = produce_episode_files(connect_redis(settings.redis_url), settings, path)
    except EpisodeFileError as exc:
        print(f"rlship produce: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"rlship produce: {problem}", file=sys.stderr)
    print(f"rlship produce: {written} groups of episodes written to run {settings.run_id}")
    return 1 if problems else 0


def produce_synthetic_episodes(settings: RunSettings, groups: int | None) -> int:
    """`--workload episodes`: synthetic groups of verifiers episodes (rlship.verifiers.synthetic)."""
    try:
        from rlship.verifiers.produce import run_synthetic_episodes
    except ImportError as exc:
        print(f"rlship produce: --workload episodes {NEEDS_VERIFIERS}: {exc}", file=sys.stderr)
        return 2
    run_synthetic_episodes(connect_redis(settings.redis_url), settings, groups=groups)
    return 0


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args).for_role("producer")
    configure_logging(settings.log_json, logging.INFO, run_id=settings.run_id)
    restrict(settings.file_mode)
    preflight_client("produce", settings).close()
    try:
        if args.episodes is not None:
            return produce_episodes(settings, args.episodes)
        if settings.workload == "episodes":
            return produce_synthetic_episodes(settings, args.groups)
        run_producer(settings, groups=args.groups)
    except (RunNotStarted, SettingsDisagree) as exc:
        print(f"rlship produce: {exc}", file=sys.stderr)
        return 2
    except DiskFull as exc:
        stop_the_run(settings, str(exc))
        print(f"rlship produce: {exc}", file=sys.stderr)
        return 1
    return 0
