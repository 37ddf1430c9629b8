"""Group cancellation: a producer that gives up on a group (a rollout of it will never
come) says so in the rollout stream (`cancel_group`), in the stream's order with its
rollouts. The orchestrator then discards the group's rollouts arrived so far (reason
`cancelled`), releases their payloads at once (Redis memory and the byte budget), rejects
any that arrive later (`group_cancelled`), and counts the group (`accounting/cancelled_groups`).
A group complete already keeps its fates. Like prime-rl's TrainSink, a cancelled group
trains nothing: its arrived rollouts are not scored against a group cut short."""

from __future__ import annotations

import json
from collections.abc import Mapping

from orchestrator.records import IDENTIFIER, InvalidRecord
from orchestrator.settings import RunSettings

CANCEL_FIELD = b"cancel"  # the stream entry's field that makes it a cancellation


def cancellation_entry(env: str, group_id: str, run: RunSettings | None) -> dict[str, str]:
    """The stream entry cancelling `group_id` of `env`; InvalidRecord naming a bad field (not
    an identifier, or an env the run, if known, does not take)."""
    run_envs = None if run is None else run.envs
    if run is not None and isinstance(run.group_size, Mapping):
        run_envs = list(run.group_size)
    for field, value in (("group_id", group_id), ("env", env)):
        if not isinstance(value, str) or not IDENTIFIER.fullmatch(value):
            raise InvalidRecord(f"cancel_group: {field}: {value!r:.80} is not an identifier")
    if run_envs is not None and env not in run_envs:
        raise InvalidRecord(f"cancel_group: env: {env!r} is not one of the run's envs {sorted(run_envs)}")
    return {CANCEL_FIELD.decode(): json.dumps({"env": env, "group_id": group_id})}


def parse_cancellation(raw: bytes) -> tuple[str, str]:
    """(env, group_id) of a cancellation entry; ValueError naming what is wrong."""
    try:
        data = json.loads(raw)
        env, group_id = data["env"], data["group_id"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"cancel: {raw!r:.80} is not {{'env', 'group_id'}} ({exc})") from None
    if not all(isinstance(v, str) and IDENTIFIER.fullmatch(v) for v in (env, group_id)):
        raise ValueError(f"cancel: {raw!r:.80} does not name an env and group by identifiers")
    return env, group_id
