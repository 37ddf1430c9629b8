"""Fuzzed settings (issue 38): valid TOML documents of random keys, real setting names
among them, with random values of every TOML type, through the settings resolution a
command does (`resolve_settings`). Each resolves, or is refused by one message naming the
setting (or the file, for a key that is none); never another exception."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import example

from orchestrator.settings import RunSettings
from orchestrator.settings_resolution import resolve_settings
from tests.support.fuzz import fuzz, json_scalar, text

SETTINGS = sorted(RunSettings.model_fields)


def _value(rng: random.Random, depth: int = 0) -> object:
    """Any TOML value: a JSON-ish scalar TOML can hold, a date, a list, a table."""
    kind = rng.randrange(8)
    if kind == 0 and depth < 2:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == 1 and depth < 2:
        return {text(rng, 4): _value(rng, depth + 1) for _ in range(rng.randint(0, 2))}
    if kind == 2:
        return rng.choice([datetime.date(2024, 1, 2), datetime.time(1, 2), datetime.datetime(2024, 1, 2, 3)])
    value = json_scalar(rng)
    if value is None or (isinstance(value, int) and not -(2**63) <= value < 2**63):
        return rng.randint(-3, 10**6)  # TOML has no null, and integers of 64 bits
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode()  # no lone surrogate: TOML is UTF-8
    return value


def _toml(value: object) -> str:
    """`value` as TOML (a key or string as a JSON string is a TOML basic string)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return value.isoformat()  # a date or time


def _document(rng: random.Random) -> dict[str, object]:
    names = [rng.choice(SETTINGS) for _ in range(rng.randint(0, 4))]
    names += [text(rng, 6) for _ in range(rng.random() < 0.1)]
    return {name.replace("_", "-") if rng.random() < 0.2 else name: _value(rng) for name in names}


@pytest.fixture(scope="module")
def config_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory) / "rlship.toml"


@fuzz(batch=25, documents=_document)  # pydantic: about 2 ms of CPU an input
@example(documents=[{"batch_size": 1e308}])
def test_a_settings_file_resolves_or_is_refused_naming_the_setting(documents, config_path):
    for document in documents:
        config_path.write_text("".join(f"{json.dumps(k)} = {_toml(v)}\n" for k, v in document.items()))
        try:
            resolve_settings(argparse.Namespace(config=config_path))
        except SystemExit as refused:
            message = str(refused)
            named = {key.replace("-", "_") for key in document} | {str(config_path)}
            assert message.startswith("rlship: "), message
            assert any(name in message for name in named), message
