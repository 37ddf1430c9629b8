"""The `rlship` command line takes what it shows: list settings as flags, choices in the help,
a description and the default actually used for every setting, unknown commands named,
`--version`. Each case runs the real CLI as a subprocess and reads its output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest

from orchestrator.settings import RunSettings
from tests.support.processes import REPO, python_command


def rlship(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI's result, with no settings from the developer's shell."""
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("RLSHIP_")}
    return subprocess.run(
        [*python_command(), *args],
        env={**clean, **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_paragraph(text: str) -> str:
    """argparse wraps help text, at spaces and after hyphens (textwrap's break_on_hyphens):
    compare it with both undone."""
    return " ".join(re.sub(r"-\n\s*", "-", text).split())


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["--envs", "math,code"], ["math", "code"]),
        (["--envs", "math"], ["math"]),
        (["--envs", '["math", "code"]'], ["math", "code"]),
        (["--envs", "math, code ,chat"], ["math", "code", "chat"]),
    ],
)
def test_a_list_setting_is_taken_from_a_flag(given: list[str], expected: list[str]) -> None:
    done = rlship("config", "show", "--json", *given)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["envs"] == expected


def test_a_list_setting_is_taken_from_the_environment_and_reaches_run() -> None:
    done = rlship("config", "show", "--json", env={"RLSHIP_ENVS": "math,code"})
    assert json.loads(done.stdout)["envs"] == ["math", "code"]
    # `rlship run` parses it too: it gets as far as its own checks (an output dir it cannot write).
    done = rlship("run", "--envs", "math", "--output-dir", "/proc/not-writable")
    assert "envs" not in done.stderr and "valid list" not in done.stderr, done.stderr
    assert "output_dir" in done.stderr


def test_help_lists_the_choices_and_describes_every_setting() -> None:
    help_text = rlship("run", "--help").stdout
    for choices in ("--transport {zmq,fs}", "--trainers {builtin,external}",
                    "--policy-source {redis,broadcasts,both}", "--wandb-mode {online,offline}"):  # fmt: skip
        assert choices in help_text, choices
    flowing = one_paragraph(help_text)
    for name, field in RunSettings.model_fields.items():
        assert field.description, f"{name} has no description"
        assert one_paragraph(field.description) in flowing, name
    assert rlship("run", "--transport", "pigeon").returncode == 2


def test_every_literal_setting_has_its_choices_in_the_help() -> None:
    """Any Literal setting added later gets its choices listed too."""
    help_text = rlship("orchestrate", "--help").stdout
    for name, field in RunSettings.model_fields.items():
        literals = [a for a in (field.annotation, *get_args(field.annotation)) if get_origin(a) is Literal]
        if literals:
            values = ",".join(v for literal in literals for v in get_args(literal))
            assert f"--{name.replace('_', '-')} {{{values}}}" in help_text, name


def test_run_shows_the_defaults_it_uses() -> None:
    """`rlship run` picks a fresh run id and runs/RUN_ID: its help and `config show` say so,
    never the model's placeholder `default`."""
    flowing = one_paragraph(rlship("run", "--help").stdout)
    assert "default a fresh id per run: run-YYYYMMDD-HHMMSS-XXXX" in flowing
    assert "default runs/RUN_ID" in flowing
    assert "default default" not in flowing and "runs/default" not in flowing
    shown = rlship("config", "show").stdout
    assert "# run_id is unset (a fresh id per run: run-YYYYMMDD-HHMMSS-XXXX)" in shown
    assert "# output_dir is unset (runs/RUN_ID)" in shown
    assert 'run_id = "default"' not in shown and "runs/default" not in shown
    values = tomllib.loads(shown)
    assert "run_id" not in values and "output_dir" not in values
    # The orchestrator alone keeps the model's default (`rlship run` passes its id on).
    assert "default default" in one_paragraph(rlship("orchestrate", "--help").stdout)
    # Given, they are shown as given.
    shown = rlship("config", "show", "--run-id", "mine", "--output-dir", "here").stdout
    assert re.search(r'^run_id = "mine" +# --run-id$', shown, re.MULTILINE)
    assert re.search(r'^output_dir = "here" +# --output-dir$', shown, re.MULTILINE)


def test_config_show_describes_every_setting() -> None:
    shown = rlship("config", "show").stdout.splitlines()
    for name, field in RunSettings.model_fields.items():
        at = next(i for i, line in enumerate(shown) if line.startswith((f"{name} = ", f"# {name} is unset")))
        assert shown[at - 1] == f"# {field.description}", name


def test_an_unknown_command_is_named_in_one_line() -> None:
    done = rlship("bogus", "--steps", "3")
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert "'bogus'" in lines[0]
    for command in ("run", "orchestrate", "trainer", "produce", "config show", "bench encode", "doctor"):
        assert command in lines[0], command
    assert "'bench nothing'" in rlship("bench", "nothing").stderr


def test_version() -> None:
    done = rlship("--version")
    assert done.returncode == 0
    with open(REPO / "pyproject.toml", "rb") as file:
        assert done.stdout.strip() == f"rlship {tomllib.load(file)['project']['version']}"


def test_bench_encode_says_what_it_is_doing_while_it_runs(tmp_path: Path) -> None:
    """A whole run takes minutes: its first lines come before it finishes (it is ended then)."""
    process = subprocess.Popen(
        [*python_command(), "bench", "encode", "--json", str(tmp_path / "b.json")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        first = [process.stderr.readline() for _ in range(2)]
        still_running = process.poll() is None
    finally:
        process.kill()
        process.communicate()
    assert first[0].startswith("bench encode: case 1/3 "), first
    assert first[1].startswith("bench encode: ") and "timing" in first[1], first
    assert still_running and not (tmp_path / "b.json").exists()


def test_the_readme_settings_table_is_the_models() -> None:
    """docs/settings.md's table is `rlship config table`'s output: a setting added, renamed,
    described or defaulted differently fails here until the page is regenerated."""
    readme = (REPO / "docs" / "settings.md").read_text()
    start, end = "<!-- settings table: rlship config table -->\n", "\n<!-- end of settings table -->"
    in_readme = readme[readme.index(start) + len(start) : readme.index(end)]
    generated = rlship("config", "table").stdout.strip()
    assert in_readme == generated, "docs/settings.md's table is stale: paste `rlship config table`"
    rows = [line for line in generated.splitlines()[2:]]
    assert [row.split("`")[1] for row in rows] == list(RunSettings.model_fields)


def test_a_command_whose_extra_is_not_installed_names_the_extra() -> None:
    """Without msgspec (hidden from this one process), `rlship bench encode` says which
    extra installs it, in one line."""
    script = (
        "import sys; sys.modules['msgspec'] = None; from orchestrator.commands.cli import main; "
        "sys.exit(main(['bench', 'encode', '--json', 'unused.json']))"
    )
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "rlship bench encode: needs the Python package 'msgspec': pip install -e '.[bench]'"
    ]


def test_the_report_without_matplotlib_names_the_install_from_a_checkout(tmp_path: Path) -> None:
    """`rlship[charts]` is not published: the line names what installs it from a checkout."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    script = (
        "import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.figure'] = None; "
        f"from orchestrator.commands.cli import main; sys.exit(main(['report', {str(tmp_path)!r}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "rlship report needs matplotlib: pip install -e '.[charts]' in the checkout"
    ]


def test_status_help_lists_only_what_status_reads() -> None:
    shown = rlship("status", "--help").stdout
    assert "--redis-url" in shown and "--follow" in shown
    assert "--batch-size" not in shown and "--zmq-port" not in shown, "not the ~40 run settings"


def test_output_to_a_closed_pipe_ends_quietly() -> None:
    """`rlship config show | head`: the reader is gone; no `Broken pipe` error, no traceback."""
    process = subprocess.Popen(
        python_command("config", "show"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    process.stdout.close()  # the reader leaves before the first line
    _, stderr = process.communicate(timeout=60)
    assert stderr == "", stderr
    assert process.returncode == 1
