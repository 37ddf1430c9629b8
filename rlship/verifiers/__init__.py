"""rlship for prime-rl's environment servers: verifiers v1 episodes in (the `.[verifiers]`
extra, verifiers 0.4.0). Not imported by `import rlship`: import `rlship.verifiers`.

- `episode_rollouts`: one episode (or its msgpack bytes) to rollouts, one per trainable
  branch, as prime-rl 559b447's train sink makes samples of it (`convert_group`: a group's,
  with what was left out by why; `grpo_advantages`: prime-rl's plain GRPO credit).
- `EpisodeProducer`, `AsyncEpisodeProducer`: a whole group of episodes a call into a run.
- `decode_episode`, `encode_episode`: an episode from and to verifiers' serve msgpack.
"""

from rlship.verifiers.conversion import (
    LOSS_STREAMS,
    Conversion,
    GroupRollouts,
    convert_group,
    decode_episode,
    encode_episode,
    episode_rollouts,
    grpo_advantages,
)
from rlship.verifiers.producers import AsyncEpisodeProducer, EpisodeProducer

__all__ = [
    "LOSS_STREAMS",
    "AsyncEpisodeProducer",
    "Conversion",
    "EpisodeProducer",
    "GroupRollouts",
    "convert_group",
    "decode_episode",
    "encode_episode",
    "episode_rollouts",
    "grpo_advantages",
]
