"""The commands do what people expect of them (issue 39, item 5), each run as a subprocess
against the real Redis, on a run written as its orchestrator leaves it
(tests/support/stored_runs.py):

- `rlship status RUN` prints once and exits, even while the run is running; `--follow`
  follows (tests/system/test_status.py follows a real run);
- `rlship config show --run-id R` shows the run's stored settings and where each came
  from; flags given on top show what a resume would do;
- `rlship doctor` on a finished run says so in one line; a run directory is taken as the
  positional, and a directory that is no run's refused in one line;
- a prefix of a flag is no flag; an `RLSHIP_*` variable that is no setting is warned of.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import redis

from orchestrator.settings import RunSettings
from tests.support.processes import refused, rlship
from tests.support.stored_runs import store_run


def moe_run(run_id: str, redis_url: str, tmp_path: Path) -> RunSettings:
    return RunSettings(
        run_id=run_id, redis_url=redis_url, workload="moe", steps=10, output_dir=tmp_path / run_id
    )


def test_status_of_a_running_run_prints_once_and_exits(
    client: redis.Redis, redis_url: str, run_id: str, tmp_path: Path
):
    store_run(client, moe_run(run_id, redis_url, tmp_path), shipped=3, running=True)
    done = rlship("status", run_id, "--redis-url", redis_url)  # stdout a pipe
    assert done.returncode == 0, done.stderr
    assert re.search(rf"^{run_id} +running +3/10 ", done.stdout, re.MULTILINE), done.stdout
    assert done.stdout.count("status: ") == 1, done.stdout
    by_directory = rlship("status", str(tmp_path / run_id), "--redis-url", redis_url)
    assert by_directory.returncode == 0 and by_directory.stdout.count("status: ") == 1, by_directory


def test_config_show_shows_a_stored_runs_settings_and_their_sources(
    client: redis.Redis, redis_url: str, run_id: str, tmp_path: Path
):
    settings = moe_run(run_id, redis_url, tmp_path)
    store_run(client, settings, shipped=2)
    env = {"REDIS_URL": redis_url}
    shown = rlship("config", "show", "--run-id", run_id, env=env)
    assert shown.returncode == 0, shown.stderr
    stored = f"# run {run_id}'s stored settings"
    lines = shown.stdout.splitlines()
    assert (
        lines[0]
        == f"{stored} (stopped, 2 of 10 steps shipped): `rlship run --run-id {run_id}` resumes it with these"
    )
    assert re.search(rf'^workload = "moe" +{stored}$', shown.stdout, re.MULTILINE), shown.stdout
    assert re.search(rf"^steps = 10 +{stored}$", shown.stdout, re.MULTILINE), shown.stdout
    assert re.search(
        r'^# wire is unset \(derived: "prime-rl-0f59b24"\) +# derived$', shown.stdout, re.MULTILINE
    )
    # Given on top: what a resume would do with them.
    again = rlship("config", "show", "--run-id", run_id, "--steps", "20", env=env)
    assert re.search(r"^steps = 20 +# --steps: 10 -> 20$", again.stdout, re.MULTILINE), again.stdout
    assert (
        json.loads(rlship("config", "show", "--json", str(settings.output_dir), env=env).stdout)["workload"]
        == "moe"
    )
    refused(
        rlship("config", "show", "--run-id", run_id, "--ranks", "4", env=env), "ranks: 2 in the run, 4 given"
    )


def test_doctor_on_a_finished_run_says_so_in_one_line(
    client: redis.Redis, redis_url: str, run_id: str, tmp_path: Path
):
    settings = moe_run(run_id, redis_url, tmp_path)
    store_run(client, settings, shipped=10, finished=True)
    for named in (["--run-id", run_id], [str(settings.output_dir)]):
        done = rlship("doctor", *named, env={"REDIS_URL": redis_url})
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            f"run {run_id} is finished, 10 of 10 steps shipped: nothing to start, so nothing to check "
            f"(`rlship status {run_id}` shows it; a new run needs another --run-id)"
        ]


def test_doctor_of_a_directory_that_is_no_runs_is_refused_in_one_line(tmp_path: Path):
    output = refused(
        rlship("doctor", str(tmp_path / "some" / "dir")), "some/dir", "is not a run's output directory"
    )
    assert "usage" not in output


def test_a_prefix_of_a_flag_is_no_flag():
    # Taken as --steps, the run would go on to its own checks: the output dir it cannot write.
    output = refused(rlship("run", "--step", "1", "--output-dir", "/proc/not-writable"), "--step")
    assert output == "rlship run: unrecognized arguments: --step 1 (did you mean --steps?)"
    refused(rlship("config", "show", "--step", "1"), "unrecognized arguments: --step", "--steps?")


def test_an_rlship_variable_that_is_no_setting_is_warned_of():
    read_elsewhere = {
        "RLSHIP_CONFIG": "", "RLSHIP_FAULTS": "0", "RLSHIP_VISIBILITY_TIMEOUT": "300",
        "RLSHIP_CI_VENV": "/tmp/venv", "RLSHIP_CHROMIUM": "/usr/bin/chromium", "RLSHIP_WIRE": "",
    }  # fmt: skip
    env = {"RLSHIP_STEP": "3", **read_elsewhere}
    for command in (["config", "show", "--json"], ["status", "--json"]):
        done = rlship(*command, env=env)
        assert done.returncode == 0, done.stderr
        warned = [line for line in done.stderr.splitlines() if any(f"{name} " in line for name in env)]
        ignored = "RLSHIP_STEP is no setting's variable and is ignored"
        assert warned == [f"rlship: warning: {ignored} (did you mean RLSHIP_STEPS?)"], done.stderr
        json.loads(done.stdout)  # the output itself is untouched
