"""rlship's public API: what an integrator's inference loop and trainer ranks import
(docs/integrators.md). The ship path itself lives in `orchestrator`, `tasks` and `transport`.

- `RolloutRecord` (`InvalidRecord`: a bad field), `RolloutProducer`, `AsyncRolloutProducer`:
  how rollouts enter a run, made for it by its id (`for_run`: `RunNotStarted`, no such run in
  Redis yet; `SettingsDisagree`, settings given that the run was not started with);
  `RolloutRejected` (bad data, named) and `AdmissionRefused` (the run has enough for now, or
  has finished); `RolloutOutcome`: what became of a rollout (`producer.outcome`).
- `REQUIRED_ARRAYS`, `OPTIONAL_TOKEN_ARRAYS`: the per-token arrays a rollout carries.
- `PayloadSegment`, `write_segment_file`, `rollout_rows_path`: per-token side arrays (routed
  experts, sampling masks) passed by handle, their rows in files under the run's payload root.
- `RunSettings`: a run's settings, as `rlship` reads them (flags, `RLSHIP_*`, a TOML file).
- `connect_redis`, `connect_redis_async`: a client of the run's Redis (a URL, or Sentinels
  and the primary they watch) that rides out a restart or a failover.
- `ZMQMicroBatchReceiver`, `FileSystemMicroBatchReceiver`: prime-rl's receiver interface,
  each step once and in order, for trainer ranks.

`rlship.verifiers` (the verifiers extra, not imported here): verifiers v1 episodes in, as
prime-rl's environment servers return them (`EpisodeProducer`, `episode_rollouts`).
"""

from orchestrator.producer import AdmissionRefused, AsyncRolloutProducer, RolloutProducer, RolloutRejected
from orchestrator.records import InvalidRecord, RolloutRecord
from orchestrator.settings import RunSettings
from orchestrator.stored_settings import RunNotStarted, SettingsDisagree
from tasks.stages.finalize import OPTIONAL_TOKEN_ARRAYS, REQUIRED_ARRAYS
from transport.connection import connect_redis, connect_redis_async
from transport.outcomes import RolloutOutcome
from transport.payload_segments import PayloadSegment, rollout_rows_path, write_segment_file
from transport.prime_receivers import FileSystemMicroBatchReceiver, ZMQMicroBatchReceiver

__all__ = [
    "OPTIONAL_TOKEN_ARRAYS",
    "REQUIRED_ARRAYS",
    "AdmissionRefused",
    "AsyncRolloutProducer",
    "FileSystemMicroBatchReceiver",
    "InvalidRecord",
    "PayloadSegment",
    "RolloutOutcome",
    "RolloutProducer",
    "RolloutRecord",
    "RolloutRejected",
    "RunNotStarted",
    "RunSettings",
    "SettingsDisagree",
    "ZMQMicroBatchReceiver",
    "connect_redis",
    "connect_redis_async",
    "rollout_rows_path",
    "write_segment_file",
]
