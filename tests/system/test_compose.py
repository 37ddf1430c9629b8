"""compose.yaml and the Procfile kept true. No container engine runs here (no `docker
compose`), so the compose file is interpolated as Compose does it (`compose_interpolate`) and
checked for what would break it: it loads with no variable set (`ps`, `logs`, `down` must
work without any), every service's command is a real entry point of this project that
accepts its options, every `RLSHIP_*` variable is a real setting, ports are on loopback,
Redis keeps an append-only file, services wait for what they need and report health,
workers restart, each run id has its own output directory, and Flower's container refuses
to start without a login (its shell runs for real). The Procfile's commands pass the same
checks, and `honcho start` runs it for real."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import click
import pytest
import yaml
from celery import Celery
from celery.app.control import Inspect
from celery.bin.celery import celery as celery_cli
from flower.options import options as flower_options

from orchestrator.commands.cli import COMMANDS, command_parser, load_command
from orchestrator.settings import CONFIG_ENV, RunSettings, env_name
from tests.support.compose import InterpolationError, compose, compose_interpolate, container_argv, procfile
from tests.support.processes import REPO, session_queue
from transport.connection import RedisAddress
from transport.zmq_sockets import free_port_pair

# Redis, the two kinds of workers, Flower, the orchestrator, the producer and the trainer ranks.
SERVICES = {"redis", "cpu-worker", "ship-worker", "flower", "orchestrator", "producer"} | {
    f"trainer-{rank}" for rank in range(2)
}
SETTINGS_ENV = {env_name(name) for name in RunSettings.model_fields} | {CONFIG_ENV}


def check_celery(argv: list[str]) -> None:
    """`celery -A tasks SUBCOMMAND ...`: the app imports and the subcommand takes every option."""
    assert argv[:3] == ["celery", "-A", "tasks"], argv
    assert isinstance(importlib.import_module("tasks").app, Celery)
    subcommand, rest = argv[3], argv[4:]
    if subcommand == "flower":  # Flower hands its options to tornado
        for token in rest:
            assert token.startswith("--") and "=" in token, f"flower option {token!r}: use --name=value"
            assert token[2:].split("=", 1)[0] in flower_options, f"flower has no option {token}"
        return
    command = celery_cli.commands[subcommand]
    takes_value = {
        opt: not (param.is_flag or param.count)
        for param in command.params
        if isinstance(param, click.Option)
        for opt in (*param.opts, *param.secondary_opts)
    }
    tokens, positionals = iter(rest), []
    for token in tokens:
        if token.startswith("-"):
            name = token.split("=", 1)[0]
            assert name in takes_value, f"celery {subcommand} has no option {name}"
            if takes_value[name] and "=" not in token:
                next(tokens)
        else:
            positionals.append(token)
    if subcommand == "inspect":
        assert positionals and hasattr(Inspect, positionals[0]), argv
    else:
        assert subcommand == "worker" and not positionals, argv


def check_rlship(argv: list[str]) -> None:
    """`rlship COMMAND ...`: a command of the CLI whose parser accepts the arguments."""
    assert argv[0] == "rlship", argv
    name = max((n for n in COMMANDS if argv[1 : 1 + len(n.split())] == n.split()), key=len, default=None)
    assert name is not None, f"{argv}: not an rlship command ({', '.join(COMMANDS)})"
    add_arguments, main = load_command(name)
    assert callable(main)
    parser = command_parser(name, exit_on_error=False)  # the CLI's own: no abbreviation passes
    add_arguments(parser)
    parser.parse_args(argv[1 + len(name.split()) :])


def check_entry_point(argv: list[str]) -> None:
    if argv[0] == "celery":
        check_celery(argv)
    else:
        check_rlship(argv)


def test_compose_services_are_entry_points() -> None:
    services = compose()["services"]
    assert set(services) == SERVICES
    redis = services.pop("redis")
    assert redis["command"][0] == "redis-server"
    assert "--appendonly yes" in " ".join(redis["command"]), redis["command"]
    for name, service in services.items():
        check_entry_point(container_argv(service["command"]))
        healthcheck = service.get("healthcheck", {}).get("test", [])
        if healthcheck and healthcheck[0] == "CMD-SHELL" and healthcheck[1].startswith("celery"):
            check_celery(shlex.split(healthcheck[1].replace("$$", "$")))
        for variable in service["environment"]:
            assert variable in SETTINGS_ENV or not variable.startswith("RLSHIP_"), f"{name}: {variable}"
        assert service["environment"]["REDIS_URL"].startswith("redis://redis:"), name


def test_compose_health_loopback_and_order() -> None:
    services = compose()["services"]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        if name == "redis":
            continue
        assert service["depends_on"]["redis"] == {"condition": "service_healthy"}, name
        if service["command"][:1] == ["celery"]:
            assert "healthcheck" in service, f"{name} serves others and has no healthcheck"
        for dependency, condition in service["depends_on"].items():
            assert "healthcheck" in services[dependency], f"{name} waits for {dependency}, which has none"
            assert condition == {"condition": "service_healthy"}, name
    assert {"cpu-worker", "ship-worker"} <= set(services["orchestrator"]["depends_on"])


def test_procfile_processes_are_entry_points() -> None:
    processes = procfile()
    assert {"cpu", "ship", "flower", "producer", "orchestrator"} <= set(processes)
    assert any(argv[:2] == ["rlship", "trainer"] for argv in processes.values())
    for argv in processes.values():
        check_entry_point(argv)
    # Flower shows the same columns however it is started.
    compose_flower = {
        t for t in container_argv(compose()["services"]["flower"]["command"]) if t.startswith("--tasks")
    }
    assert compose_flower == {t for t in processes["flower"] if t.startswith("--tasks")} != set()


def test_dockerfile_copies_every_package() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = setuptools["packages"]
    if isinstance(packages, dict):  # [tool.setuptools.packages.find]: include patterns
        packages = packages["find"]["include"]
    for top in {package.split(".")[0].rstrip("*") for package in packages}:
        assert re.search(rf"^COPY {top} {top}$", dockerfile, re.MULTILINE), f"Dockerfile does not copy {top}/"


def test_honcho_runs_the_procfile(redis_url: str, tmp_path: Path) -> None:
    """`honcho start` against the Redis at REDIS_URL ships the steps; the orchestrator's exit
    ends the run."""
    suffix = uuid.uuid4().hex[:8]
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "REDIS_URL": redis_url,
        "RLSHIP_RUN_ID": f"honcho-{suffix}",
        "RLSHIP_STEPS": "2",
        "RLSHIP_BATCH_SIZE": "16",
        "RLSHIP_GROUP_SIZE": "4",
        "RLSHIP_SEQ_LEN": "512",
        "RLSHIP_ZMQ_PORT": str(free_port_pair()),
        "RLSHIP_CPU_QUEUE": session_queue(f"cpu-honcho-{suffix}"),
        "RLSHIP_SHIP_QUEUE": session_queue(f"ship-honcho-{suffix}"),
        "RLSHIP_OUTPUT_DIR": str(tmp_path / "run"),
        "FLOWER_PORT": str(free_port_pair()),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "honcho", "start", "-f", str(REPO / "Procfile"), "-e", str(empty_env_file)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=50)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
        pytest.fail(f"honcho start did not finish in 50 s:\n{output[-4000:]}")
    stops = re.findall(r"\| (\w+)\.1 stopped \(rc=(-?\d+)\)", output)
    assert process.returncode == 0 and stops and stops[0] == ("orchestrator", "0"), output[-4000:]
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 2, output[-4000:]


def test_compose_loads_with_no_variable_set() -> None:
    """`docker compose ps`, `logs` and `down` load the file too: nothing in it may be required.
    A `${VAR:?...}` anywhere would stop them (the interpolation's own check: it fails so)."""
    compose({})
    with pytest.raises(InterpolationError, match="FLOWER_BASIC_AUTH"):
        compose_interpolate("--basic_auth=${FLOWER_BASIC_AUTH:?set it}", {})


def test_each_run_id_has_its_own_output_dir() -> None:
    """Every service of a run agrees on its id and writes under /data/runs/{run id}; a second
    run (another id) shares no file with the first. Its Redis keys are under rlship:{run id}:."""
    dirs = {}
    for run in ("r1", "r2"):
        services = compose({"RLSHIP_RUN_ID": run})["services"]
        environments = [s["environment"] for name, s in services.items() if name != "redis"]
        assert {e["RLSHIP_RUN_ID"] for e in environments} == {run}
        (dirs[run],) = {e["RLSHIP_OUTPUT_DIR"] for e in environments}
        assert RunSettings(run_id=run, output_dir=dirs[run]).output_dir.name == run
    assert dirs == {"r1": "/data/runs/r1", "r2": "/data/runs/r2"}
    assert "docker compose down -v" in (REPO / "docs" / "operating.md").read_text()


def test_workers_restart_and_flower_does_not() -> None:
    """A worker exits when its consumer dies under a restarting Redis: Compose starts it
    again. Flower without a login exits on purpose: restarting it would only loop."""
    services = compose()["services"]
    for name in ("cpu-worker", "ship-worker"):
        assert services[name].get("restart") in ("always", "unless-stopped", "on-failure"), name
    assert services["flower"].get("restart", "no") == "no"


def flower_container(env: dict[str, str], bin_dir: Path) -> subprocess.CompletedProcess[str]:
    """Flower's container command, run by a real shell with `env` as the container's
    environment (Compose's interpolation of FLOWER_BASIC_AUTH included); `celery` on its
    PATH is a stand-in that prints the argv and the login it was started with."""
    service = compose(env)["services"]["flower"]
    environment = {k: v for k, v in service["environment"].items() if k == "FLOWER_BASIC_AUTH"}
    return subprocess.run(
        service["command"],
        env={"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", **environment},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_flower_container_refuses_to_start_without_a_login(tmp_path: Path) -> None:
    """Flower listens beyond loopback in its container: without FLOWER_BASIC_AUTH=user:password
    the container exits at once with one line saying so; with it, Flower is started with the
    login in its environment (where Flower reads it), not on its command line."""
    celery = tmp_path / "celery"
    celery.write_text('#!/bin/sh\nprintf "%s\\n" "$@"; echo "login=$FLOWER_BASIC_AUTH"\n')
    celery.chmod(0o755)
    for env in ({}, {"FLOWER_BASIC_AUTH": ""}, {"FLOWER_BASIC_AUTH": "no-password"}):
        refused = flower_container(env, tmp_path)
        assert refused.returncode != 0 and refused.stdout == "", (env, refused)
        assert refused.stderr.count("\n") == 1 and "set FLOWER_BASIC_AUTH=user:password" in refused.stderr
    started = flower_container({"FLOWER_BASIC_AUTH": "operator:s3cret"}, tmp_path)
    assert started.returncode == 0, started.stderr
    *argv, login = started.stdout.splitlines()
    assert login == "login=operator:s3cret" and not any("s3cret" in token for token in argv)
    check_celery(["celery", *argv])
    options = dict(token[2:].split("=", 1) for token in argv if token.startswith("--"))
    assert options["address"] not in ("127.0.0.1", "localhost", "::1")
    assert "basic_auth" in flower_options  # Flower reads FLOWER_{OPTION} for each of its options


def test_the_sentinel_variant_points_every_rlship_service_at_sentinels_watching_its_redis() -> None:
    """compose.sentinel.yaml over compose.yaml (Compose merges a service's maps): every
    service built from this project gets a Sentinel REDIS_URL that the settings accept, names
    Sentinels the file defines, waits for them, and the name they monitor is the URL's."""
    base = compose()
    override = compose_interpolate(yaml.safe_load((REPO / "compose.sentinel.yaml").read_text()), {})
    services = override["services"]
    rlship_services = [name for name, service in base["services"].items() if "build" in service]
    assert rlship_services and all(name in services for name in rlship_services)
    for name in rlship_services:
        environment = {**base["services"][name].get("environment", {}), **services[name]["environment"]}
        address = RedisAddress.parse(RunSettings(redis_url=environment["REDIS_URL"]).redis_url)
        assert address.is_sentinel, name
        named = {host for host, _ in address.sentinels}
        assert named <= set(services) and named <= set(services[name]["depends_on"]), name
        for sentinel in named:
            script = services[sentinel]["command"][2]
            assert f"sentinel monitor {address.master_name} redis 6379 2" in script
            assert "--sentinel" in script
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1 : replica.index("--replicaof") + 3] == ["redis", "6379"]
