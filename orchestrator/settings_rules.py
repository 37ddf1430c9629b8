"""The rules a run's settings keep across fields (`SettingsRules`, `RunSettings`' base):
the settings that, left unset, follow others, the combinations refused at start-up, and
how the settings of a mapping or model are read from a flag or variable (`group_size`,
`length_penalty`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings

from transport.connection import RedisAddress
from transport.keys import run_queue
from transport.numbering import PRIME_RL_FIRST_STEP
from transport.schema import default_wire

# Settings that, left unset, follow others (`RunSettings._resolve_derived`).
DERIVED_SETTINGS = (
    "first_step", "start_step", "policy_source", "broadcast_dir", "cpu_queue", "ship_queue",
    "redis_wait_replicas", "wire", "payload_root", "zmq_keys_dir",
)  # fmt: skip


# A run's group size: one for every env, or one per env.
GroupSize = Annotated[int, Field(ge=1)] | dict[str, Annotated[int, Field(ge=1)]]


def pairs(value: str, setting: str) -> dict[str, str]:
    """`name=value,name=value` (a flag or variable) as a mapping; ValueError naming `setting`."""
    out = {}
    for item in (part.strip() for part in value.split(",")):
        name, equals, given = item.partition("=")
        if not equals or not name.strip() or not given.strip():
            raise ValueError(f"{setting}: {item!r} is not name=value")
        out[name.strip()] = given.strip()
    return out


class SettingsRules(BaseSettings):
    """Validators and readers `RunSettings` inherits; every field is its own."""

    @property
    def largest_group_size(self) -> int:
        """The run's group size, or the largest of its envs'."""
        sizes = self.group_size
        return max(sizes.values()) if isinstance(sizes, Mapping) else sizes

    @field_validator("group_size", mode="before", check_fields=False)
    @classmethod
    def _group_size_text(cls, value: Any) -> Any:
        """`8`, or `math=8,code=4` (a flag or variable), or a JSON object (how
        `settings_to_env` passes a mapping on); a TOML table or an int as it is."""
        if not isinstance(value, str) or value.strip().lstrip("-").isdigit():
            return value
        if value.lstrip().startswith("{"):
            return json.loads(value)
        return pairs(value, "group_size")

    @field_validator("length_penalty", mode="before", check_fields=False)
    @classmethod
    def _length_penalty_text(cls, value: Any) -> Any:
        """`linear` (prime-rl's default weights), `none`, weight=value pairs, or a JSON object."""
        if not isinstance(value, str):
            return value
        if value.strip() in ("", "none"):
            return None
        if value.strip() == "linear":
            return {}
        if value.lstrip().startswith("{"):
            return json.loads(value)
        return pairs(value, "length_penalty")

    @model_validator(mode="after")
    def _resolve_derived(self) -> Self:
        """Settings left unset follow others (`DERIVED_SETTINGS`). Numbering follows the
        trainers: prime-rl's (external) count from 1, the builtin trainer's run directories
        and checkpoints from 0; so does the policy source: Redis for rlship's trainers,
        prime-rl's broadcast directory (in the output directory unless given) for external
        ones; the queues are the run's own. Resolved here, so every consumer sees values,
        and kept out of the fields set, so a copy made by `with_changes` (`model_copy` does
        not validate) derives them afresh."""
        unset = {name for name in DERIVED_SETTINGS if getattr(self, name) is None}
        if self.first_step is None:
            self.first_step = PRIME_RL_FIRST_STEP if self.trainers == "external" else 0
        if self.start_step is None:
            self.start_step = self.first_step
        if self.policy_source is None:
            self.policy_source = "redis" if self.trainers == "builtin" else "broadcasts"
        if self.broadcast_dir is None:
            self.broadcast_dir = Path(self.output_dir) / "broadcasts"
        if self.payload_root is None:
            self.payload_root = Path(self.output_dir) / "payloads"
        if self.zmq_keys_dir is None:
            self.zmq_keys_dir = Path(self.output_dir) / "keys"
        if self.wire is None:
            self.wire = default_wire(self.workload).name  # type: ignore[assignment]
        if self.cpu_queue is None:
            self.cpu_queue = run_queue(self.run_id, "cpu")
        if self.ship_queue is None:
            self.ship_queue = run_queue(self.run_id, "ship")
        if self.redis_wait_replicas is None:
            self.redis_wait_replicas = 1 if RedisAddress.parse(self.redis_url).is_sentinel else 0
        self.__pydantic_fields_set__.difference_update(unset)
        if self.start_step < self.first_step:
            raise ValueError(
                f"start_step: {self.start_step} must be >= first_step ({self.first_step}): "
                "the run cannot start before its first step"
            )
        return self

    @model_validator(mode="after")
    def _wire_carries_the_workload(self) -> Self:
        """A workload whose fields the trainers' wire has no place for fails at start-up, not
        at its first step."""
        if self.workload == "moe" and self.wire == "prime-rl-559b447":
            raise ValueError(
                "wire: prime-rl-559b447 cannot carry the field payload (the moe workload passes "
                "routed experts by handle); use --wire prime-rl-0f59b24"
            )
        return self

    @model_validator(mode="after")
    def _curve_needs_rlship_ranks(self) -> Self:
        """Stock prime-rl ranks speak no CURVE: they would wait for steps that never come."""
        stock = self.trainers == "external" and self.external_ranks == "stock"
        if self.zmq_curve and self.transport == "zmq" and stock:
            raise ValueError(
                "zmq_curve: stock prime-rl ranks speak no CURVE; give --external-ranks rlship if "
                "they receive with transport.prime_receivers, else see docs/trainers.md, "
                '"On a shared network"'
            )
        return self

    @model_validator(mode="after")
    def _replay_covers_async_steps(self) -> Self:
        """The policy gate lets max_async_level + 2 steps be unacknowledged at once; a rank
        that restarts must be able to replay all of them."""
        if self.replay_steps < self.max_async_level + 2:
            raise ValueError(
                f"replay_steps: {self.replay_steps} must be >= max_async_level + 2 "
                f"({self.max_async_level + 2}), or a restarted rank could miss a step"
            )
        return self

    @model_validator(mode="after")
    def _group_sizes_name_the_envs(self) -> Self:
        """A run that names its envs and sizes its groups per env sizes each of its envs."""
        sizes, envs = self.group_size, self.envs
        if isinstance(sizes, Mapping) and envs is not None and set(envs) - set(sizes):
            raise ValueError(
                f"group_size: {dict(sizes)} has no size for env(s) {sorted(set(envs) - set(sizes))} "
                f"of the run's envs {envs}"
            )
        return self
