"""Run settings: one model (`RunSettings`), read from the environment (`RLSHIP_*`,
`REDIS_URL`) and passed on to child processes the same way (`settings_to_env`). A command
puts a TOML file and its flags on top (orchestrator.settings_resolution)."""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from orchestrator.groups import LengthPenalty
from orchestrator.settings_rules import DERIVED_SETTINGS, GroupSize, SettingsRules
from tasks.app import DEFAULT_REDIS_URL, VISIBILITY_TIMEOUT_ENV
from tasks.faults import FAULTS_ENV
from tasks.logs import mask_secrets
from tasks.manifest import ShipConfig
from tasks.stages.record_names import PRIME_RL_559B447, RecordNames
from transport.connection import SENTINEL_SCHEME, RedisAddress, with_credentials
from transport.keys import is_run_queue, run_queue  # noqa: F401 (importers take run_queue from here)
from transport.payload_dir import PayloadDirectory
from transport.payload_segments import RunRows
from transport.run_files import FileMode

CONFIG_ENV = "RLSHIP_CONFIG"
# `RLSHIP_*` variables that are no setting but are read: by the workers (faults, the broker's
# visibility timeout), by .ci/run (its venv) and by the tests (the browser the Flower test drives).
OTHER_VARIABLES = frozenset(
    {CONFIG_ENV, FAULTS_ENV, VISIBILITY_TIMEOUT_ENV, "RLSHIP_CI_VENV", "RLSHIP_CHROMIUM"}
)
REDIS_SCHEMES = ("redis", "rediss", "unix", "sentinel")
# The processes of a run by what they may do in Redis: each may connect as its own ACL user
# (`redis_{role}_auth`, `rlship acl`).
ROLES = ("producer", "worker", "orchestrator", "trainer")
# Settings whose values hold credentials: shown and reported only through `shown_value`.
SECRET_SETTINGS = frozenset({"redis_url", *(f"redis_{role}_auth" for role in ROLES)})


class RunSettings(SettingsRules):
    # A setting that is not one (a typo) is an error, never silently ignored: `_known_settings`.
    model_config = SettingsConfigDict(env_prefix="RLSHIP_", extra="forbid", populate_by_name=True)

    run_id: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="names the run's Redis keys and worker names; a run resumes under the same id",
    )
    redis_url: str = Field(
        default=DEFAULT_REDIS_URL,
        validation_alias=AliasChoices("REDIS_URL", "redis_url"),
        description="the run's one Redis: broker, result backend and every client (or its Sentinels: "
        "sentinel://host:port;... ending in ?master_name=NAME); TLS: rediss://, or Sentinels, with "
        "?ssl_ca_certs=CA&ssl_certfile=CERT&ssl_keyfile=KEY",
    )
    redis_producer_auth: str | None = Field(
        default=None,
        pattern=r"^[^:\s]+:.+$",
        description="USER:PASSWORD a producer connects to Redis as (unset: redis_url's); `rlship acl` "
        "prints the user's rules",
    )
    redis_worker_auth: str | None = Field(
        default=None,
        pattern=r"^[^:\s]+:.+$",
        description="USER:PASSWORD the Celery workers connect to Redis as, their broker included (unset: "
        "redis_url's)",
    )
    redis_orchestrator_auth: str | None = Field(
        default=None,
        pattern=r"^[^:\s]+:.+$",
        description="USER:PASSWORD the orchestrator connects to Redis as (unset: redis_url's)",
    )
    redis_trainer_auth: str | None = Field(
        default=None,
        pattern=r"^[^:\s]+:.+$",
        description="USER:PASSWORD the trainer ranks connect to Redis as (unset: redis_url's)",
    )
    redis_wait_replicas: int | None = Field(
        default=None,
        ge=0,
        description="replicas that must acknowledge each write exactly-once depends on (WAIT) before "
        "anything acts on it (unset: 1 with Sentinels, 0 with one Redis)",
    )
    redis_wait_timeout_ms: int = Field(
        default=1000,
        ge=1,
        description="how long one WAIT waits for the replicas before it is logged and waited again",
    )
    steps: int = Field(default=5, ge=1, description="steps to ship, then stop")
    first_step: int | None = Field(
        default=None,
        ge=0,
        le=1,
        description="the number of a training run's first step, 0 or 1 (unset: 1 with external "
        "trainers, as prime-rl numbers them; 0 with the builtin trainer)",
    )
    start_step: int | None = Field(
        default=None,
        ge=0,
        description="the step the trainers expect next: a trainer resumed from a checkpoint "
        "expects its resume step (unset: first_step)",
    )
    ranks: int = Field(default=2, ge=1, description="trainer ranks; a step sends each its own payload")
    transport: Literal["zmq", "fs"] = Field(
        default="zmq", description="how batches reach the ranks: ZMQ sockets, or files in output_dir"
    )
    zmq_host: str = Field(default="127.0.0.1", description="the address the ship worker binds its sockets on")
    zmq_port: int = Field(
        default=5555, ge=1, le=65534, description="the ship worker's data port; the next one takes READY"
    )
    zmq_curve: bool = Field(
        default=False,
        description="encrypt the ZMQ sockets and admit only the run's ranks (CURVE, keys made by "
        "`rlship keys`): on a shared network no one else receives the steps or announces READY",
    )
    zmq_keys_dir: Path | None = Field(
        default=None,
        description="the run's CURVE key files (`rlship keys`; each host needs only its side's); "
        "unset: output_dir/keys",
    )
    external_ranks: Literal["stock", "rlship"] = Field(
        default="stock",
        description="what external trainer ranks receive with: prime-rl's stock receivers, or rlship's "
        "(transport.prime_receivers), which zmq_curve needs",
    )
    batch_size: int = Field(default=64, ge=1, description="rollouts per step")
    group_size: Annotated[GroupSize, NoDecode] = Field(
        default=8,
        description="rollouts per prompt (one advantage group): one size, or one per env as env=size "
        "pairs, comma-separated (math=8,code=4); an env without one is rejected",
    )
    seq_len: int = Field(default=2048, ge=8, description="tokens per packed sample")
    pad_to_multiple: int = Field(default=1, ge=1, description="packed lengths are padded to a multiple")
    vocab_size: int = Field(default=151_936, ge=2, description="token ids must be below this")
    seed: int = Field(default=0, description="seeds the synthetic producer")
    output_dir: Path = Field(
        default=Path("runs/default"), description="metrics.jsonl, samples/, logs/ and checkpoints of the run"
    )
    file_mode: FileMode = Field(
        default="owner",
        description="who may read the files and directories the run creates (output_dir, payload_root, "
        "rows, payload and rank files): owner (0700 directories, 0600 files) or group (0750, 0640); rows "
        "and rank files another user could have written are refused either way",
    )
    envs: Annotated[list[str] | None, NoDecode] = Field(
        default=None, description="the run's envs, comma-separated; others are rejected (unset: any)"
    )
    max_async_level: int = Field(
        default=1, ge=0, description="steps the ship path may run ahead of the trainers' policy"
    )
    max_off_policy_steps: int = Field(
        default=8, ge=0, description="a rollout generated this many policy versions back is dropped"
    )
    normalize_advantages: bool = Field(default=False, description="divide advantages by the group's std")
    length_penalty: Annotated[LengthPenalty | None, NoDecode] = Field(
        default=None,
        description="prime-rl's GRPO length shaping of the rewards rlship takes the group baseline of: "
        "linear (its default weights), or weight=value pairs, comma-separated, of num_output_tokens_weight "
        "(0.25), num_input_tokens_weight (0.1), num_turns_weight (0.1); unset: none",
    )
    trainers: Literal["builtin", "external"] = Field(
        default="builtin", description="rlship's trainer ranks, or external ones (prime-rl)"
    )
    policy_source: Literal["redis", "broadcasts", "both"] | None = Field(
        default=None,
        description="where the policy gate reads the trainers' version: redis (rlship trainer), "
        "broadcasts (prime-rl's broadcast_dir/step_N/STABLE) or both; unset: redis for builtin "
        "trainers, broadcasts for external",
    )
    broadcast_dir: Path | None = Field(
        default=None, description="prime-rl's weight-broadcast directory; unset: output_dir/broadcasts"
    )
    workload: Literal["dense", "moe", "moe-inline", "episodes"] = Field(
        default="dense",
        description="what the synthetic producer makes: dense rollouts, or moe (each also with routed "
        "experts of a 48-layer top-8 model, uint8, written to files under payload_root and passed by "
        "handle), or moe-inline (the same routed experts inline, as trainers on wire 559b447 take them), "
        "or episodes (groups of verifiers v1 episodes: multi-turn, tool-using, forked, some with "
        "per-token advantages, some errored; needs the verifiers extra)",
    )
    wire: Literal["prime-rl-559b447", "prime-rl-0f59b24"] | None = Field(
        default=None,
        description="the trainers' MicroBatch layout: prime-rl's at commit 559b447 (16 fields) or 0f59b24 "
        "(20: side arrays by handle, trace ids); unset: 0f59b24 for the moe workload, else 559b447",
    )
    payload_root: Path | None = Field(
        default=None,
        description="the shared directory side arrays passed by handle live under (producers write "
        "there, trainer ranks read there); unset: output_dir/payloads",
    )
    payload_store: Literal["redis", "dir"] = Field(
        default="redis",
        description="where encoded per-rank payloads (the replay window) are kept: in Redis, or in files "
        "under output_dir/step-payloads/{run_id} (shared with the ship worker and the trainer ranks; "
        "Redis then holds pointers), and where producers' inline side arrays wait for the cut",
    )
    cpu_workers: int = Field(default=2, ge=1, description="processes of the cpu worker (compute stages)")
    cpu_worker_max_memory_mib: int = Field(
        default=2048, ge=64, description="a cpu pool process grown past this is replaced after its task"
    )
    cpu_queue: str | None = Field(
        default=None,
        description="the Celery queue of the compute stages (unset: the run's own, rlship.{run_id}.cpu; "
        "name one to let a pool of cpu workers serve several runs)",
    )
    ship_queue: str | None = Field(
        default=None,
        description="the Celery queue of the send stage, served by one worker (unset: the run's own, "
        "rlship.{run_id}.ship)",
    )
    bind_wait_seconds: float = Field(
        default=5.0,
        ge=0,
        le=3600,
        description="how long the ship worker retries binding a ZMQ port another process holds (a "
        "replaced ship worker of the run may still be letting go of it) before the run stops naming it",
    )
    samples_per_step: int = Field(default=4, ge=0, description="rollouts per step written to samples/")
    wandb_project: str | None = Field(default=None, description="log records to Weights & Biases")
    wandb_mode: Literal["online", "offline"] = Field(default="offline", description="the W&B mode")
    dedupe_horizon: int = Field(default=1 << 16, ge=1, description="rollout ids and groups remembered")
    record_names: RecordNames = Field(
        default=PRIME_RL_559B447,
        description="the record's names: prime-rl-559b447 (prime-rl's orchestrator at 559b447) or "
        "rlship-1 (rlship's earlier names and prime-rl 0002457f's, for existing dashboards)",
    )
    record_rollouts: Path | None = Field(
        default=None, description="write one JSON line per finalized rollout"
    )
    max_outstanding_rollouts: int = Field(default=0, ge=0, description="producer backlog; 0 = 4 batches")
    max_held_bytes: int = Field(
        default=8 << 30,
        ge=0,
        description="bytes the run may hold for its producers (rollouts not yet released, with their rows "
        "files, and retained payloads, in Redis or files); a producer waits while they would pass it, and "
        "a rollout, call or step larger than it is refused at once; 0: no bound",
    )
    log_json: bool = Field(
        default=False, description="log JSON lines (time, level, logger, message, run_id, step, rank)"
    )
    replay_steps: int = Field(
        default=8, ge=1, description="steps whose payloads stay in Redis until every rank acknowledges them"
    )
    max_empty_steps: int = Field(
        default=3,
        ge=1,
        description="the run stops once this many cuts in a row had every rollout dropped by the workers",
    )
    stall_seconds: float = Field(
        default=30.0, gt=0, description="a step without progress this long is enqueued again"
    )
    ack_timeout: float = Field(
        default=30.0, ge=0, description="seconds the end of a run waits for ranks to acknowledge"
    )
    rank_timeout: float = Field(
        default=0.0,
        ge=0,
        description="stop the run, naming the rank, when a trainer rank the run waits on has not "
        "announced READY nor taken a step for this many seconds (0: off, wait and name it)",
    )
    allow_eviction: bool = Field(
        default=False, description="run on a Redis that may evict keys (warned, not refused)"
    )
    # Operators' views (issue 15): the orchestrator's Prometheus endpoint.
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="serve Prometheus metrics on this port from the orchestrator (0: off, as "
        "runs sharing a host would collide on any fixed port)",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        description="the address the Prometheus endpoint binds (0.0.0.0: every interface)",
    )

    @model_validator(mode="before")
    @classmethod
    def _known_settings(cls, values: Any) -> Any:
        """A name that is no setting is refused, naming the closest one (`batchsize`: did you
        mean `batch_size`?), rather than left to a generic "extra inputs" error."""
        if not isinstance(values, dict):
            return values
        known = {*cls.model_fields, "REDIS_URL"}
        unknown = [name for name in values if name not in known]
        if unknown:
            problems = []
            for name in unknown:
                close = difflib.get_close_matches(name, cls.model_fields, n=1)
                problems.append(
                    f"{name!r} is not a setting" + (f" (did you mean {close[0]!r}?)" if close else "")
                )
            raise ValueError("; ".join(problems) + " (`rlship config table` lists them)")
        return values

    @field_validator(
        "wandb_project",
        "record_rollouts",
        "envs",
        "policy_source",
        "broadcast_dir",
        "first_step",
        "start_step",
        "cpu_queue",
        "ship_queue",
        "redis_wait_replicas",
        "wire",
        "payload_root",
        "zmq_keys_dir",
        "length_penalty",
        *(f"redis_{role}_auth" for role in ROLES),
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        """An empty variable means unset, which is how `settings_to_env` passes None on."""
        return None if value == "" else value

    @field_validator("envs", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """A flag or variable gives a list as `math,code`; a JSON list (how `settings_to_env`
        passes it on) is read too."""
        if not isinstance(value, str) or not value.strip():
            return value  # an empty one is unset (`_empty_is_unset`)
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [item.strip() for item in value.split(",") if item.strip()]

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        scheme = urlsplit(value).scheme
        if scheme not in REDIS_SCHEMES:
            raise ValueError(f"the scheme must be one of {', '.join(REDIS_SCHEMES)}, not {scheme!r}")
        RedisAddress.parse(value)
        if scheme == SENTINEL_SCHEME:
            return value
        database = urlsplit(value).path.strip("/") if scheme != "unix" else ""
        if database and not database.isdigit():
            raise ValueError(f"the database after the port must be a number (as /0), not {database!r}")
        return value

    def for_role(self, role: str) -> RunSettings:
        """These settings for a process of `role`: Redis reached as its user, when it has one."""
        auth = getattr(self, f"redis_{role}_auth")
        return self.with_changes(redis_url=with_credentials(self.redis_url, auth)) if auth else self

    def derived(self) -> set[str]:
        """The settings `_resolve_derived` derived rather than was given."""
        return set(DERIVED_SETTINGS) - self.model_fields_set

    def with_changes(self, **changes: Any) -> RunSettings:
        """A copy with `changes`, validated again (`model_copy(update=...)` is not), the
        settings that were derived (not set) derived afresh from the new values."""
        values = self.model_dump(exclude=self.derived() - changes.keys())
        return type(self).model_validate({**values, **changes})

    def values_for(self, record: type, **computed: Any) -> dict[str, Any]:
        """A value for each field of `record` (a dataclass or a pydantic model) made of run
        settings: the same-named setting, so a field added to it needs no line of its own;
        `computed` gives the fields whose value is not a plain copy."""
        names = record.model_fields if issubclass(record, BaseModel) else [f.name for f in fields(record)]
        return {**{name: getattr(self, name) for name in names if name not in computed}, **computed}

    def payload_directory(self) -> PayloadDirectory | None:
        return self.ship_config().payload_directory(self.run_id)

    def run_rows(self) -> RunRows:
        """The run's own files of side-array rows (under `payload_root`)."""
        return RunRows(Path(str(self.payload_root)), self.run_id)

    def ship_config(self) -> ShipConfig:
        """What the workers need of the settings. Paths travel as text: the manifest is
        msgpack, which has no paths."""
        return ShipConfig(
            **self.values_for(
                ShipConfig,
                output_dir=str(self.output_dir),
                payload_root=str(self.payload_root),
                zmq_keys_dir=str(self.zmq_keys_dir),
            )
        )

    @property
    def step_numbers(self) -> range:
        """The steps this run ships: `steps` of them from `start_step`."""
        assert self.start_step is not None  # resolved by _resolve_derived
        return range(self.start_step, self.start_step + self.steps)

    @property
    def outstanding_limit(self) -> int:
        return self.max_outstanding_rollouts or 4 * self.batch_size


def queue_label(queue: str) -> str:
    """How a display names a queue: a run's own (`run_queue`) by its kind, another by its name."""
    return queue.rpartition(".")[2] if is_run_queue(queue) else queue


def env_name(name: str) -> str:
    """The environment variable a setting is read from."""
    return "REDIS_URL" if name == "redis_url" else f"RLSHIP_{name.upper()}"


def unknown_variables(environment: Collection[str]) -> list[str]:
    """A line for each `RLSHIP_*` variable in `environment` that nothing reads (a typo:
    `RLSHIP_STEP` for `RLSHIP_STEPS` would otherwise be ignored without a word), naming the
    closest setting's variable."""
    variables = [env_name(name) for name in RunSettings.model_fields]
    lines = []
    for variable in sorted(key.upper() for key in environment):
        if variable.startswith("RLSHIP_") and variable not in variables and variable not in OTHER_VARIABLES:
            close = difflib.get_close_matches(variable, variables, n=1)
            hint = f"did you mean {close[0]}?" if close else "`rlship config table` lists the settings"
            lines.append(f"{variable} is no setting's variable and is ignored ({hint})")
    return lines


def shown_value(name: str, value: Any) -> Any:
    """A setting's value as it may be printed or logged: a URL's password, or a role's, masked."""
    if name not in SECRET_SETTINGS or not isinstance(value, str):
        return value
    return mask_secrets(value) if name == "redis_url" else value.partition(":")[0] + ":***"


def _variable_value(value: Any) -> str:
    return "" if value is None else json.dumps(value) if isinstance(value, list | dict) else str(value)


def settings_to_env(settings: RunSettings) -> dict[str, str]:
    """The settings as environment variables, for child processes. None travels as an empty
    value, lists and mappings as JSON, and `RLSHIP_CONFIG` is emptied: the values are already
    resolved, and a child that read the file again would let it override the parent's flags.
    Derived settings travel unset too: the child derives the same values, and knows them as
    derived."""
    values = {**settings.model_dump(mode="json"), **dict.fromkeys(settings.derived())}
    env = {env_name(name): _variable_value(value) for name, value in values.items()}
    env[CONFIG_ENV] = ""
    return env
