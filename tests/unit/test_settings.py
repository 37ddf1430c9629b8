"""Settings: environment < TOML file < flags, read with real environment variables and files;
`rlship config show` masks secrets; an invalid value stops start-up naming the setting, its
value and its source."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from orchestrator.commands.cli import main as rlship
from orchestrator.settings import RunSettings, settings_to_env
from orchestrator.settings_resolution import add_settings_arguments, resolve_settings, settings_from_args
from tasks.logs import mask_secrets
from tasks.manifest import ShipConfig
from tests.support.processes import REPO, python_command


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets: settings variables of the developer's shell would leak in."""
    for name in list(os.environ):
        if name.upper().startswith("RLSHIP_") or name.upper() == "REDIS_URL":
            monkeypatch.delenv(name)


def write_toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_environment_then_file_then_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RLSHIP_STEPS", "7")
    monkeypatch.setenv("RLSHIP_RANKS", "3")
    monkeypatch.setenv("RLSHIP_BATCH_SIZE", "5")
    monkeypatch.setenv("REDIS_URL", "redis://envhost:6379/2")
    config = write_toml(tmp_path / "run.toml", 'ranks = 4\nbatch-size = 32\ntransport = "fs"\n')

    resolved = resolve_settings(parse("--config", str(config), "--batch-size", "8"))

    settings = resolved.settings
    assert (settings.steps, settings.ranks, settings.batch_size) == (7, 4, 8)
    assert settings.transport == "fs" and settings.redis_url == "redis://envhost:6379/2"
    assert settings.group_size == RunSettings.model_fields["group_size"].default
    assert resolved.sources["steps"] == "RLSHIP_STEPS"
    assert resolved.sources["ranks"] == str(config)
    assert resolved.sources["batch_size"] == "--batch-size"
    assert resolved.sources["redis_url"] == "REDIS_URL"
    assert resolved.sources["seed"] == "default"


def test_config_file_from_environment_and_flag_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from_env = write_toml(tmp_path / "env.toml", "ranks = 5\nseed = 9\n")
    from_flag = write_toml(tmp_path / "flag.toml", "ranks = 6\n")
    monkeypatch.setenv("RLSHIP_CONFIG", str(from_env))
    assert settings_from_args(parse()).ranks == 5
    settings = settings_from_args(parse("--config", str(from_flag)))
    assert (settings.ranks, settings.seed) == (6, 0)


def test_children_get_the_resolved_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What a child reads back from `settings_to_env` is what the parent resolved: unset stays
    unset (not the string "None"), and the parent's config file cannot override its flags."""
    monkeypatch.setenv("RLSHIP_CONFIG", str(write_toml(tmp_path / "run.toml", "ranks = 9\n")))
    parent = settings_from_args(parse("--ranks", "3", "--normalize-advantages", "--log-json"))
    assert parent.wandb_project is None and parent.record_rollouts is None
    for name, value in settings_to_env(parent).items():
        monkeypatch.setenv(name, value)
    child = settings_from_args(parse())
    assert child == parent and child.log_json
    assert not settings_from_args(parse("--no-log-json")).log_json


def test_a_runs_queues_are_its_own_unless_named() -> None:
    """Left unset, a run's queues are named after it (and follow a new run id, in a child
    too); a queue an operator names is kept."""
    run = RunSettings(run_id="r1")
    assert (run.cpu_queue, run.ship_queue) == ("rlship.r1.cpu", "rlship.r1.ship")
    assert run.with_changes(run_id="r2").ship_queue == "rlship.r2.ship"
    assert settings_to_env(run)["RLSHIP_CPU_QUEUE"] == "", "derived: the child derives it again"
    shared = RunSettings(run_id="r1", cpu_queue="pool")
    assert (shared.cpu_queue, shared.with_changes(run_id="r2").cpu_queue) == ("pool", "pool")


def test_a_name_that_is_no_setting_is_refused_naming_the_closest() -> None:
    """A typo is never silently ignored (`batchsize` would leave admission at 64)."""
    with pytest.raises(ValueError, match=r"'batchsize' is not a setting \(did you mean 'batch_size'\?\)"):
        RunSettings(batchsize=16)
    with pytest.raises(ValueError, match=r"'colour' is not a setting \(`rlship config table` lists them\)"):
        RunSettings(colour="blue")


def test_ship_config_is_the_same_named_settings(tmp_path: Path) -> None:
    """Each field of the workers' config is the run setting of its name (`output_dir` as
    text), checked on settings that all differ from the config's defaults."""
    settings = RunSettings(
        ranks=3, seq_len=128, transport="fs", zmq_host="10.0.0.2", zmq_port=6000,
        output_dir=tmp_path / "run", pad_to_multiple=16, vocab_size=1000, cpu_queue="compute",
        ship_queue="send", samples_per_step=2, replay_steps=9, first_step=1, bind_wait_seconds=2.5,
        redis_wait_replicas=2, redis_wait_timeout_ms=250, wire="prime-rl-0f59b24",
        payload_root=tmp_path / "rows", payload_store="dir", dedupe_horizon=4096, zmq_curve=True,
        zmq_keys_dir=tmp_path / "keys", file_mode="group", record_names="rlship-1",
    )  # fmt: skip
    config = settings.ship_config()
    for field in dataclasses.fields(ShipConfig):
        setting = getattr(settings, field.name)
        expected = str(setting) if isinstance(setting, Path) else setting
        assert getattr(config, field.name) == expected, field.name
        assert expected != field.default, f"{field.name}: pick a value other than the default"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://:secret@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://user:secret@cache.internal:6380/1", "rediss://user:***@cache.internal:6380/1"),
        ("redis://host:6379/0?password=secret&db=1", "redis://host:6379/0?password=***&db=1"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_secrets(url) == masked


@pytest.mark.parametrize("url", ["redis://:secret@host:6379/0", "rediss://user:secret@host:6380/1"])
def test_config_show_masks_the_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    monkeypatch.setenv("REDIS_URL", url)
    assert rlship(["config", "show", "--ranks", "3"]) == 0
    shown = capsys.readouterr().out
    assert "secret" not in shown
    assert f'redis_url = "{mask_secrets(url)}"' in shown
    assert rlship(["config", "show", "--json"]) == 0
    values = json.loads(capsys.readouterr().out)
    assert values["redis_url"] == mask_secrets(url) and values["ranks"] == 2


def test_config_show_reads_back_as_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The TOML it prints, with where each value came from, is a config file for the same run."""
    monkeypatch.setenv("RLSHIP_SEED", "42")
    assert rlship(["config", "show", "--ranks", "3", "--wandb-project", "demo"]) == 0
    shown = capsys.readouterr().out
    lines = {line.split(" = ")[0]: line for line in shown.splitlines()}
    assert lines["seed"].endswith("# RLSHIP_SEED") and lines["ranks"].endswith("# --ranks")
    assert "# record_rollouts is unset" in shown
    monkeypatch.delenv("RLSHIP_SEED")
    config = write_toml(tmp_path / "shown.toml", shown)
    expected = RunSettings(seed=42, ranks=3, wandb_project="demo")
    assert settings_from_args(parse("--config", str(config))) == expected
    assert tomllib.loads(shown)["ranks"] == 3


@pytest.mark.parametrize(
    ("argv", "environment", "expected"),
    [
        (["--ranks", "0"], {}, ["ranks='0'", "--ranks", "greater than or equal to 1"]),
        ([], {"RLSHIP_TRANSPORT": "carrier-pigeon"}, ["transport='carrier-pigeon'", "RLSHIP_TRANSPORT"]),
        ([], {"RLSHIP_STEPS": "many"}, ["steps='many'", "RLSHIP_STEPS", "integer"]),
        ([], {"REDIS_URL": "http://u:secret@host"}, ["redis_url='http://u:***@host'", "REDIS_URL", "scheme"]),
    ],
)
def test_invalid_value_names_the_setting(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], environment: dict[str, str], expected: list[str]
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stopped:
        settings_from_args(parse(*argv))
    message = str(stopped.value.code)
    assert message.startswith("rlship: invalid setting: ")
    for part in expected:
        assert part in message
    assert "secret" not in message


def test_config_file_errors_name_the_file_and_key(tmp_path: Path) -> None:
    misspelt = write_toml(tmp_path / "misspelt.toml", "rank = 2\n")
    with pytest.raises(SystemExit, match=r"misspelt\.toml: unknown setting\(s\) rank"):
        settings_from_args(parse("--config", str(misspelt)))
    wrong_type = write_toml(tmp_path / "wrong.toml", 'ranks = "many"\n')
    with pytest.raises(SystemExit, match=r"ranks='many' \(from .*wrong\.toml\)"):
        settings_from_args(parse("--config", str(wrong_type)))
    broken = write_toml(tmp_path / "broken.toml", "ranks = \n")
    with pytest.raises(SystemExit, match=r"broken\.toml: invalid TOML"):
        settings_from_args(parse("--config", str(broken)))
    with pytest.raises(SystemExit, match=r"absent\.toml"):
        settings_from_args(parse("--config", str(tmp_path / "absent.toml")))


def test_invalid_value_stops_rlship_run_before_it_starts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("RLSHIP_")}
    finished = subprocess.run(
        [*python_command(), "run", "--output-dir", str(tmp_path / "run")],
        env={**env, "RLSHIP_TRANSPORT": "carrier-pigeon", "PYTHONPATH": str(REPO)},
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert finished.returncode == 2, "an invalid setting is an operator's mistake (exit status 2)"
    assert "transport='carrier-pigeon' (from RLSHIP_TRANSPORT)" in finished.stderr
    assert not (tmp_path / "run").exists()
