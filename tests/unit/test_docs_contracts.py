"""The contracts in docs/ against the code they describe; the documents are the oracle.

A Redis key accessor added to (or removed from) `RunKeys`, or a `StepValue`, without its row in
docs/redis-keys.md, or a wire field moved, renamed or made optional in transport/schema.py
without docs/wire-format.md saying so, fails here. Pure: no Redis, no workers.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from transport.keys import RunKeys, StepValue
from transport.schema import OPTIONAL_FIELDS, WIRE_0F59B24, WIRE_559B447, WireProfile

DOCS = Path(__file__).resolve().parents[2] / "docs"
# A row of the wire-format field table: | 3 | `inference_logprobs` | wire type | yes/no | ... |
WIRE_FIELD_ROW = re.compile(r"^\| (\d+) \| `(\w+)` \| [^|]+ \| (yes|no) \|", re.MULTILINE)


def named_in(document: str, owner: str) -> set[str]:
    """The members of `owner` the document names as `owner.member`."""
    return set(re.findall(rf"\b{owner}\.(\w+)", (DOCS / document).read_text()))


def run_keys_accessors() -> set[str]:
    """RunKeys' key names: its public methods and properties (its dataclass fields are
    what it is built from, not keys)."""
    built_from = {field.name for field in dataclasses.fields(RunKeys)}
    return {name for name, _ in inspect.getmembers(RunKeys) if not name.startswith("_")} - built_from


def step_values() -> set[str]:
    """The names of the values a step stores."""
    return {value.name for value in StepValue}


def test_every_run_keys_accessor_has_its_row_in_redis_keys_md():
    assert run_keys_accessors() - named_in("redis-keys.md", "RunKeys") == set()


def test_every_step_value_has_its_row_in_redis_keys_md():
    assert step_values() - named_in("redis-keys.md", "StepValue") == set()


def test_redis_keys_md_names_no_key_the_code_does_not_have():
    assert named_in("redis-keys.md", "RunKeys") - run_keys_accessors() == set()
    assert named_in("redis-keys.md", "StepValue") - step_values() == set()


def wire_tables() -> list[list[tuple[str, str, str]]]:
    """The field tables of wire-format.md, in order: 559b447's, then 0f59b24's."""
    text = (DOCS / "wire-format.md").read_text()
    sections = text.split("## Wire profiles")
    return [WIRE_FIELD_ROW.findall(section) for section in sections]


@pytest.mark.parametrize(("table", "wire"), [(0, WIRE_559B447), (1, WIRE_0F59B24)])
def test_wire_format_md_lists_each_profiles_fields_in_order(table: int, wire: WireProfile):
    rows = wire_tables()[table]
    assert [int(index) for index, _, _ in rows] == list(range(len(wire.fields)))
    assert tuple(name for _, name, _ in rows) == wire.fields


@pytest.mark.parametrize(("table", "wire"), [(0, WIRE_559B447), (1, WIRE_0F59B24)])
def test_wire_format_md_marks_exactly_the_optional_fields(table: int, wire: WireProfile):
    rows = wire_tables()[table]
    assert {name for _, name, required in rows if required == "no"} == OPTIONAL_FIELDS & set(wire.fields)


def test_the_task_arguments_redis_keys_md_names_are_the_tasks():
    """Flower shows a task's arguments by position: the names the docs give them are the
    tasks' own parameters, in order."""
    import tasks.ship  # noqa: F401 - registers the tasks
    from tasks.app import app

    text = (DOCS / "redis-keys.md").read_text()
    documented = {args for args in re.findall(r"`\((run_id[^)]*)\)`", text)}
    actual = {
        ", ".join(inspect.signature(app.tasks[name].run).parameters)
        for name in app.tasks
        if name.startswith("rlship.")
    }
    assert documented == actual
