"""The rollout record: the small message a producer appends to the rollout stream after
storing the rollout's arrays under its key. Validated at the edge with pydantic; a bad
record is rejected with an error naming the field and the value, and costs nothing else."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

IDENTIFIER_PATTERN = r"^[A-Za-z0-9_.\-/]{1,200}$"
IDENTIFIER = re.compile(IDENTIFIER_PATTERN)
Identifier = Annotated[str, Field(pattern=IDENTIFIER_PATTERN)]
PLAIN_NAME = re.compile(r"[\w\[\]]+")  # a field, or pydantic's `[key]` of a mapping's key


class TraceCounts(BaseModel):
    """The whole trace a rollout is one branch of, as prime-rl counts a trace: a branch
    cannot give these (a forked trace's branches share tokens, verifiers counts a shared
    call once in a trace's input and total, its output once per branch)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Identifier  # unique within its episode
    num_input_tokens: int = Field(ge=0)
    num_output_tokens: int = Field(ge=0)
    num_total_tokens: int = Field(ge=0)
    num_branches: int = Field(ge=0)  # a trace that failed before its first message has none


class RecordFields(BaseModel):
    """The record's fields and their rules. Stream records are validated strictly against
    these (`parse_record`); `RolloutRecord` adds the producer's constructor."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    rollout_id: Identifier
    group_id: Identifier
    task_id: Identifier
    env: Identifier
    policy_version: int = Field(ge=0)
    reward: float
    num_input_tokens: int = Field(ge=0)
    num_output_tokens: int = Field(ge=0)
    num_turns: int = Field(default=1, ge=0)
    temperature: float = Field(default=1.0, gt=0)
    is_truncated: bool = False
    error: Identifier | None = None
    cancelled: bool = False
    stop_condition: Identifier | None = None
    metrics: dict[Identifier, float] = Field(default_factory=dict)
    # The agent that produced the rollout (a verifiers trace's `agent.name`); unset: verifiers'
    # default name `agent` in the record's per-agent statistics.
    agent: Identifier | None = None
    # How many rollouts the group has when not the run's group_size: a group of episodes
    # gives one rollout per trainable branch (rlship.verifiers), however many that is.
    group_rollouts: int | None = Field(default=None, ge=1)
    # The episode the rollout is of, and the trace it is a branch of (rlship.verifiers): the
    # record's statistics count traces and episodes as prime-rl 559b447 does. Unset: the
    # rollout is an episode of its own; no trace: a trace of its own of one branch.
    episode_id: Identifier | None = None
    trace: TraceCounts | None = None

    @model_validator(mode="after")
    def _trace_of_an_episode(self) -> RecordFields:
        if self.trace is not None and self.episode_id is None:
            raise ValueError("trace: given without episode_id (a trace is one of an episode)")
        return self

    @property
    def num_tokens(self) -> int:
        return self.num_input_tokens + self.num_output_tokens


class InvalidRecord(ValueError):
    """A rollout record built with a bad field: one line naming each field, what it must be
    and the value given."""


class RolloutRecord(RecordFields):
    """A rollout's record, as a producer builds it: a bad field raises InvalidRecord
    (`RolloutRecord: reward: Input should be a finite number (got nan)`), not pydantic's
    multi-line error."""

    def __init__(self, **fields: Any) -> None:
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            raise InvalidRecord(f"RolloutRecord: {describe_validation_error(exc)}") from None


class RecordRejected(ValueError):
    """A stream record that cannot be used; `reason` is the short label it is counted under."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem: the field, what is wrong, and the value received. A field name
    that is not a plain word is quoted (an extra key `''` or `a: b` would blur the line)."""
    parts = []
    for problem in error.errors(include_url=False):
        field = ".".join(p if PLAIN_NAME.fullmatch(p) else repr(p) for p in map(str, problem["loc"]))
        field = field or "<record>"
        parts.append(f"{field}: {problem['msg']} (got {problem.get('input')!r:.80})")
    return "; ".join(parts)


def parse_record(data: bytes | str) -> RolloutRecord:
    """Parse one stream record (JSON), or raise RecordRejected naming the field and value.
    Strict: each field must have its JSON type (`"reward": "1"` or `true` is not a number,
    `"is_truncated": 1` is not a boolean), so what a producer meant is never guessed."""
    try:
        fields = RecordFields.model_validate_json(data, strict=True)  # no custom __init__: strict holds
        return RolloutRecord.model_construct(fields.model_fields_set, **dict(fields))
    except ValidationError as exc:
        reason = "invalid_json" if any(p["type"] == "json_invalid" for p in exc.errors()) else "invalid_field"
        raise RecordRejected(reason, describe_validation_error(exc)) from exc
