"""Episodes into a run from the command line, through an EpisodeProducer as the run admits
each group:
- `rlship produce --episodes PATH`: a file holds one or more episodes as verifiers' serve
  encoding packs them (msgpack, back to back); a directory, every `*.msgpack` file in it, by
  name. Episodes are grouped by env and group id in the order read; each whole group (the
  run's group_size for its env) is written;
- `rlship produce` of a run with `--workload episodes` (as `rlship run` starts it): synthetic
  groups (rlship.verifiers.synthetic), stamped with the trainers' policy version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import redis
import verifiers.v1 as vf
from pydantic import ValidationError
from verifiers.v1.episode import WireEpisode

from orchestrator.admission import FINISHED, AdmissionRefused
from orchestrator.commands.produce import WAIT_REPORT_SECONDS, workload_envs
from orchestrator.groups import group_size_of
from orchestrator.records import RecordRejected, describe_validation_error
from orchestrator.rollout_checks import RolloutRejected
from orchestrator.settings import RunSettings
from rlship.verifiers.producers import EpisodeProducer
from rlship.verifiers.synthetic import SyntheticEpisodes

log = logging.getLogger("rlship.producer")


class EpisodeFileError(ValueError):
    """A file that does not hold verifiers episodes: names the file, the episode's place in
    it and what is wrong."""


def episode_files(path: Path) -> list[Path]:
    """The file, or a directory's `*.msgpack` files by name (EpisodeFileError: none)."""
    files = sorted(path.glob("*.msgpack")) if path.is_dir() else [path]
    if not files or not all(file.is_file() for file in files):
        raise EpisodeFileError(f"--episodes: {path} is not a file, nor a directory of *.msgpack files")
    return files


def read_episodes(path: Path) -> Iterator[vf.Episode]:
    """Every episode of the file or directory, in order, as verifiers' client validates them
    (EpisodeFileError: bytes that are not msgpack, a file cut short, a record that is not an
    episode)."""
    for file in episode_files(path):
        with open(file, "rb") as data:
            unpacker = msgpack.Unpacker(data, raw=False, strict_map_key=False)
            read = 0
            try:
                for record in unpacker:
                    yield _episode(file, read, record)
                    read += 1
            except EpisodeFileError:
                raise
            except (ValueError, msgpack.UnpackException) as exc:
                raise EpisodeFileError(f"{file}: after {read} episodes: not msgpack ({exc})") from None
            if unpacker.tell() != file.stat().st_size:
                raise EpisodeFileError(f"{file}: cut short after {read} whole episodes (a partial write?)")


def _episode(file: Path, index: int, record: object) -> vf.Episode:
    try:
        return WireEpisode.model_validate(record)
    except ValidationError as exc:
        raise EpisodeFileError(
            f"{file}: episode {index}: not a verifiers episode: {describe_validation_error(exc)}"
        ) from None


def produce_episode_files(client: redis.Redis, settings: RunSettings, path: Path) -> tuple[int, list[str]]:
    """Write every whole group of the files' episodes into the run, waiting while it refuses
    for now; the groups written, and what was not (a rejected group, an incomplete one, the
    rest once the run has finished), one line each."""
    producer = EpisodeProducer.for_run(client, settings)
    groups: dict[tuple[str, str], list[vf.Episode]] = {}
    written, problems = 0, []
    for episode in read_episodes(path):
        key = (str(episode.env.name), episode.group.id if episode.group else "")
        groups.setdefault(key, []).append(episode)
        try:
            size = group_size_of(settings.group_size, key[0])
        except RecordRejected as exc:
            problems.append(f"episode {episode.id!r}: {exc}")
            groups.pop(key)
            continue
        if len(groups[key]) < size:
            continue
        outcome = _produce(producer, groups.pop(key))
        if outcome == FINISHED:
            problems.append(f"run {settings.run_id} has finished: the rest of {path} was not written")
            return written, problems
        if outcome:
            problems.append(outcome)
        else:
            written += 1
    for (env, group), episodes in groups.items():
        problems.append(
            f"group {group!r} of env {env!r}: {len(episodes)} episodes, fewer than the run's group "
            "size: not written"
        )
    log.info(
        "episodes: %d groups written; traces that trained nothing: %d errored, %d of agents that do "
        "not train, %d with nothing to train",
        written,
        producer.errored_traces,
        producer.not_trainable_traces,
        producer.untrained_traces,
    )
    return written, problems


def run_synthetic_episodes(
    client: redis.Redis, settings: RunSettings, stop: threading.Event | None = None, groups: int | None = None
) -> int:
    """Synthetic groups of episodes into the run until `groups` are written, `stop` is set or
    the run has finished; a group the run refuses for good is skipped, saying why. The
    groups written."""
    producer = EpisodeProducer.for_run(client, settings)
    synthetic = SyntheticEpisodes(
        settings.run_id, settings.seed, settings.group_size, workload_envs(settings),
        settings.seq_len, settings.vocab_size,
    )  # fmt: skip
    written = 0
    while (groups is None or written < groups) and not (stop is not None and stop.is_set()):
        outcome = _produce(producer, synthetic.group(producer.rollouts.policy_version()), stop)
        if stop is not None and stop.is_set():
            break
        if outcome == FINISHED:
            log.info("run %s has finished; the producer stops", settings.run_id)
            break
        if outcome:
            log.warning("%s; group skipped", outcome)
        else:
            written += 1
    return written


def _produce(
    producer: EpisodeProducer, episodes: list[vf.Episode], stop: threading.Event | None = None
) -> str | None:
    """Write one group as the run admits it: None once written (or told to stop), FINISHED, or
    why not."""
    reported = 0.0
    while not (stop is not None and stop.is_set()):
        try:
            producer.produce(episodes, timeout=0.5)
            return None
        except RolloutRejected as exc:
            return str(exc)
        except AdmissionRefused as exc:
            if exc.reason == FINISHED:
                return FINISHED
            if not exc.passes:
                return str(exc)
            if time.monotonic() - reported >= WAIT_REPORT_SECONDS:
                log.warning("producer waits: %s", exc)
                reported = time.monotonic()
    return None
