"""Run settings: one model, read from the environment (`RLSHIP_*`, `REDIS_URL`) and then
overridden by command-line flags. An invalid value stops start-up naming the setting."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from tasks.app import DEFAULT_REDIS_URL
from tasks.manifest import ShipConfig


class RunSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLSHIP_", extra="ignore", populate_by_name=True)

    run_id: str = Field(default="default", pattern=r"^[A-Za-z0-9_.\-]+$")
    redis_url: str = Field(default=DEFAULT_REDIS_URL, validation_alias=AliasChoices("REDIS_URL", "redis_url"))
    steps: int = Field(default=5, ge=1)
    ranks: int = Field(default=2, ge=1)
    transport: Literal["zmq", "fs"] = "zmq"
    zmq_host: str = "127.0.0.1"
    zmq_port: int = Field(default=5555, ge=1, le=65534)
    batch_size: int = Field(default=64, ge=1)
    group_size: int = Field(default=8, ge=1)
    seq_len: int = Field(default=2048, ge=8)
    pad_to_multiple: int = Field(default=1, ge=1)
    vocab_size: int = Field(default=151_936, ge=2)
    seed: int = 0
    output_dir: Path = Path("runs/default")
    envs: list[str] | None = Field(default=None, description="the run's envs; others are rejected")
    max_async_level: int = Field(default=1, ge=0)
    max_off_policy_steps: int = Field(default=8, ge=0)
    normalize_advantages: bool = False
    trainers: Literal["builtin", "external"] = "builtin"
    cpu_workers: int = Field(default=2, ge=1)
    cpu_queue: str = "cpu"
    ship_queue: str = "ship"
    samples_per_step: int = Field(default=4, ge=0, description="rollouts per step written to samples/")
    wandb_project: str | None = Field(default=None, description="log records to Weights & Biases")
    wandb_mode: Literal["online", "offline"] = "offline"
    dedupe_horizon: int = Field(default=1 << 16, ge=1, description="rollout ids and groups remembered")
    record_rollouts: Path | None = Field(
        default=None, description="write one JSON line per finalized rollout"
    )
    max_outstanding_rollouts: int = Field(default=0, ge=0, description="producer backlog; 0 = 4 batches")

    def ship_config(self) -> ShipConfig:
        return ShipConfig(
            ranks=self.ranks,
            seq_len=self.seq_len,
            transport=self.transport,
            zmq_host=self.zmq_host,
            zmq_port=self.zmq_port,
            output_dir=str(self.output_dir),
            pad_to_multiple=self.pad_to_multiple,
            vocab_size=self.vocab_size,
            cpu_queue=self.cpu_queue,
            ship_queue=self.ship_queue,
            samples_per_step=self.samples_per_step,
        )

    @property
    def outstanding_limit(self) -> int:
        return self.max_outstanding_rollouts or 4 * self.batch_size


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per setting (default: unset, so the environment's value stands)."""
    for name, field in RunSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, dest=name, default=None, help=field.description)


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    """Environment, then flags; exits with a message naming the bad setting."""
    overrides = {n: v for n in RunSettings.model_fields if (v := getattr(args, n, None)) is not None}
    try:
        return RunSettings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}={e.get('input')!r}: {e['msg']}" for e in exc.errors()
        )
        raise SystemExit(f"rlship: invalid setting: {problems}") from exc


def settings_to_env(settings: RunSettings) -> dict[str, str]:
    """The settings as environment variables, for child processes: unset ones stay unset,
    lists travel as JSON (how pydantic-settings reads them back)."""
    env = {
        f"RLSHIP_{name.upper()}": json.dumps(value) if isinstance(value, list) else str(value)
        for name, value in settings.model_dump(mode="json").items()
        if value is not None
    }
    env["REDIS_URL"] = settings.redis_url
    del env["RLSHIP_REDIS_URL"]
    return env
