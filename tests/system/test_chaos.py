"""`rlship chaos` end to end: a short seeded run while workers, the ship worker and the
orchestrator are killed, compared with a fault-free run of the same workload."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from orchestrator.commands.chaos.kills import Kill, kill_if_alive
from orchestrator.commands.chaos.report import compare, print_report
from tests.support.processes import REPO, left_running, python_command, refused

pytestmark = pytest.mark.timeout(400)


def chaos(tmp_path: Path, *options: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`rlship chaos` with a kill every 0.2 s and `options`; what it printed and its report."""
    path = tmp_path / "chaos.json"
    done = subprocess.run(
        python_command("chaos", "--kill-every", "0.2", "--timeout", "150", "--json", str(path), *options),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert path.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    return done, json.loads(path.read_text())


def test_chaos_delivers_every_step_once_in_order_and_identical(tmp_path):
    done, report = chaos(tmp_path, "--steps", "8")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert report["goal_met"]
    assert report["steps_delivered_per_rank"] == {"0": 8, "1": 8}
    assert report["duplicates_delivered"] == report["out_of_order"] == report["payload_mismatches"] == 0
    assert report["records_published"] == 8 and report["keys_left"] == 0
    assert report["kills"] >= 10
    assert {"orchestrator", "ship-worker", "stage-fault"} <= set(report["kills_by_target"])
    assert "goal MET" in done.stdout


@pytest.mark.parametrize(
    "options",
    [["--workload", "moe"], ["--workload", "moe-inline", "--payload-store", "dir"]],
    ids=["routed-experts-by-handle", "inline-in-a-payload-directory"],
)
def test_chaos_with_routed_experts_delivers_every_step_and_leaves_no_file(tmp_path, options):
    """Mixture-of-experts steps (48 layers, top-8): routed experts by handle, their rows read
    by the ranks and compared with the fault-free run's; or inline, with the payloads and the
    replay window in files. Every kill as above; nothing left in Redis or on disk."""
    done, report = chaos(tmp_path, "--steps", "8", *options)
    assert done.returncode == 0 and report["goal_met"], done.stdout[-2000:] + done.stderr[-2000:]
    assert report["steps_delivered_per_rank"] == {"0": 8, "1": 8}
    assert report["duplicates_delivered"] == report["out_of_order"] == report["payload_mismatches"] == 0
    assert report["keys_left"] == report["files_left"] == 0
    assert {"orchestrator", "ship-worker"} <= set(report["kills_by_target"])


def test_chaos_with_the_redis_primary_killed_twice_among_the_other_kills(tmp_path):
    """Both runs on a primary, a replica and three Sentinels of their own; the chaos run's
    primary is SIGKILLed twice (each time the killed server rejoins as a replica)."""
    done, report = chaos(tmp_path, "--steps", "12", "--kill-redis-primary", "2")
    assert done.returncode == 0 and report["goal_met"], done.stdout[-2000:] + done.stderr[-2000:]
    assert report["kills_by_target"]["redis-primary"] == 2
    assert report["steps_delivered_per_rank"] == {"0": 12, "1": 12}
    assert report["duplicates_delivered"] == report["out_of_order"] == report["payload_mismatches"] == 0
    assert report["records_published"] == 12 and report["keys_left"] == 0
    left = [p.pid for p in psutil.process_iter(["cwd"]) if str(tmp_path) in (p.info["cwd"] or "")]
    assert not left, "the chaos command stopped its Redis servers and Sentinels (each runs in its directory)"


def test_chaos_with_stock_receivers_reports_no_duplicate_outside_the_window_and_no_hang(tmp_path):
    """Ranks that receive as prime-rl's do (READY once, no duplicate check, no replay),
    the ship worker killed twice among the other kills."""
    # What an earlier invocation with the same --json left: its ranks' records of step 1.
    for name in ("reference", "chaos"):
        earlier = tmp_path / name / "stock" / "rank-0.jsonl"
        earlier.parent.mkdir(parents=True)
        earlier.write_text(json.dumps({"step": 1, "topic_step": 1, "sha256": "0" * 64}) + "\n")
    done, report = chaos(tmp_path, "--steps", "8", "--receivers", "stock", "--ship-kills", "2")
    # A ship worker killed after a message left it and before its mark reached Redis (one
    # round trip) has it sent again: the window README's Reliability states. A duplicate
    # from anywhere else, a lost step or a hang fails.
    window = report["duplicates_in_window"]
    assert done.returncode == (0 if window == 0 else 1), done.stdout[-2000:] + done.stderr[-2000:]
    assert report["goal_met"] == (window == 0) and report["receivers"] == "stock"
    assert report["steps_delivered_per_rank"] == {"0": 8, "1": 8}
    assert report["duplicates_delivered"] == window <= sum(report["interrupted_sends"].values())
    assert report["out_of_order"] <= window and report["payload_mismatches"] == 0
    assert report["hung_ranks"] == [] and report["kills_by_target"]["ship-worker"] == 2
    assert "send" not in report["kills_by_stage"], "the send fault fires inside the window by design"


def stock_observation(orders: dict[str, list[int]], redone: dict[str, int]) -> dict:
    """What `observe_stock` gives for ranks that recorded these topic steps, in order."""
    ranks = {
        rank: {
            "checksums": {str(s): f"sha-{s}" for s in order},
            "deliveries": {str(s): order.count(s) for s in set(order)},
            "order": order,
            "rows": {},
        }
        for rank, order in orders.items()
    }
    return {
        "ranks": ranks, "records": [1, 2, 3], "keys_left": [], "hung_ranks": [], "wall_seconds": 1.0,
        "rollouts_written": 24, "interrupted_sends": redone, "kills": [Kill(0.5, "ship-worker", step=2)],
        "sent": {}, "files_left": [],
    }  # fmt: skip


@pytest.mark.timeout(10)
def test_a_stock_duplicate_counts_in_the_window_only_where_its_send_was_redone():
    args = argparse.Namespace(
        steps=3,
        kill_every=0.2,
        receivers="stock",
        ship_kills=1,
        kill_redis_primary=0,
        workload="dense",
        payload_store="redis",
        json=Path("chaos.json"),
    )
    checksums = {str(s): f"sha-{s}" for s in (1, 2, 3)}
    expected = {"ranks": {r: {"checksums": checksums, "rows": {}} for r in "01"},
                "keys_left": [], "wall_seconds": 1.0}  # fmt: skip
    # Rank 0 got step 2 twice; the ship worker that sent it to rank 0 died before its mark.
    redone = compare(
        args, range(1, 4), expected, stock_observation({"0": [1, 2, 2, 3], "1": [1, 2, 3]}, {"2:0": 1})
    )
    assert (redone["duplicates_delivered"], redone["duplicates_in_window"], redone["out_of_order"]) == (
        1,
        1,
        1,
    )
    assert not redone["goal_met"], "a duplicate misses the goal, in the window or not"
    # The same duplicate with no interrupted send behind it (or one to another rank) is not.
    for interrupted in ({}, {"2:1": 1}, {"3:0": 1}):
        other = compare(
            args, range(1, 4), expected, stock_observation({"0": [1, 2, 2, 3], "1": [1, 2, 3]}, interrupted)
        )
        assert (other["duplicates_delivered"], other["duplicates_in_window"]) == (1, 0), interrupted


def test_steps_with_handles_compare_by_their_rows_and_by_what_their_run_sent():
    """Each run names its own rows files, so its payloads differ from the fault-free run's in
    their paths: a step matches when it is what its run sent and its rows read the same."""
    args = argparse.Namespace(
        steps=2, kill_every=0.2, receivers="rlship", ship_kills=1, kill_redis_primary=0,
        workload="moe", payload_store="redis", json=Path("chaos.json"),
    )  # fmt: skip
    expected = {"ranks": {"0": {"checksums": {"1": "a1", "2": "a2"}, "rows": {"1": "r1", "2": "r2"}}},
                "keys_left": [], "wall_seconds": 1.0}  # fmt: skip

    def observed(checksums: dict, rows: dict) -> dict:
        ranks = {"0": {"checksums": checksums, "deliveries": {"1": 1, "2": 1}, "order": [1, 2], "rows": rows}}
        return {
            "ranks": ranks, "records": [1, 2], "keys_left": [], "hung_ranks": [], "wall_seconds": 1.0,
            "rollouts_written": 8, "kills": [], "sent": {"1:0": "b1", "2:0": "b2"}, "files_left": [],
        }  # fmt: skip

    same = compare(args, range(1, 3), expected, observed({"1": "b1", "2": "b2"}, {"1": "r1", "2": "r2"}))
    assert same["payload_mismatches"] == 0
    other_rows = compare(args, range(1, 3), expected, observed({"1": "b1", "2": "b2"}, {"1": "r1", "2": "x"}))
    assert other_rows["payload_mismatches"] == 1
    not_sent = compare(args, range(1, 3), expected, observed({"1": "b1", "2": "a2"}, {"1": "r1", "2": "r2"}))
    assert not_sent["payload_mismatches"] == 1


@pytest.mark.timeout(10)
def test_a_run_with_too_few_kills_misses_the_goal_and_says_so():
    """Every step delivered clean is not enough: a run over before ten kills took effect (one
    too fast for its --kill-every) misses the goal, and the summary says that is why."""
    args = argparse.Namespace(
        steps=3, kill_every=0.4, receivers="rlship", ship_kills=1, kill_redis_primary=0,
        workload="dense", payload_store="redis", json=Path("chaos.json"),
    )  # fmt: skip
    checksums = {str(s): f"sha-{s}" for s in (1, 2, 3)}
    expected = {"ranks": {r: {"checksums": checksums, "rows": {}} for r in "01"},
                "keys_left": [], "wall_seconds": 1.0}  # fmt: skip
    clean = stock_observation({"0": [1, 2, 3], "1": [1, 2, 3]}, {})
    base = [Kill(0.4, "orchestrator", step=2), Kill(0.8, "ship-worker", step=4)]
    unfired = Kill(1.2, "stage-fault", "pack", 3, fired=False)
    clean["kills"] = base + [Kill(1.0 + i / 10, "cpu-worker-child") for i in range(7)] + [unfired]
    few = compare(args, range(1, 4), expected, clean)
    assert not few["goal_met"] and few["goal_missed_by"] == [
        "9 kills, fewer than 10 (more steps or a shorter --kill-every)"
    ]
    clean["kills"] = base + [Kill(1.0 + i / 10, "cpu-worker-child") for i in range(8)]
    enough = compare(args, range(1, 4), expected, clean)
    assert enough["goal_met"] and enough["goal_missed_by"] == []
    clean["kills"] = [Kill(1.0 + i / 10, "cpu-worker-child") for i in range(10)]
    no_orchestrator = compare(args, range(1, 4), expected, clean)
    assert no_orchestrator["goal_missed_by"] == ["0 orchestrator kills of 1", "0 ship-worker kills of 1"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_report(few, Path("chaos.json"))
    assert "goal MISSED: 9 kills, fewer than 10" in printed.getvalue()


@pytest.mark.timeout(120)
def test_a_run_that_cannot_finish_is_one_line_and_leaves_nothing(tmp_path, client):
    """Its keys, its queues and its processes go with it, whatever stopped it."""
    done = subprocess.run(
        python_command("chaos", "--steps", "2", "--timeout", "0.5", "--json", str(tmp_path / "chaos.json")),
        cwd=REPO, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    refused(done, "no end after 0.5 s", "logs in")
    run_id = re.search(r"\((chaos-reference-\w+)\)", done.stdout).group(1)
    token = run_id.rsplit("-", 1)[1]
    assert list(client.scan_iter(match=f"rlship:chaos-*-{token}:*")) == []
    assert list(client.scan_iter(match=f"*chaos-*-{token}*")) == [], "a queue or its binding"
    assert left_running(token) == []
    assert not (tmp_path / "chaos.json").exists()


@pytest.mark.timeout(120)
def test_a_run_that_stops_names_the_orchestrators_cause_and_keeps_its_logs(tmp_path):
    """The reference run's ship worker cannot bind its sockets (`zmq_host` an address not
    this machine's, TEST-NET-1): its orchestrator stops the run at the first step, and the
    command says so in its own words and where every log of the run is kept."""
    done = subprocess.run(
        python_command(
            "chaos", "--steps", "1", "--batch-size", "8", "--seq-len", "128", "--timeout", "60",
            "--json", str(tmp_path / "chaos.json"),
        ),
        env={**os.environ, "RLSHIP_ZMQ_HOST": "192.0.2.1"},
        cwd=REPO, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    line = refused(done, "the orchestrator exited with 2", "cannot bind 192.0.2.1:")
    found = re.search(r"(chaos-reference-(\w+)): .*: run \1 stopped: .*; its logs are kept in (\S+)$", line)
    assert found, line
    logs = Path(found[3])
    assert logs == tmp_path / f"reference-{found[2]}" / "logs", "beside --json, in the run's directory"
    assert "cannot bind 192.0.2.1:" in (logs / "orchestrator.log").read_text()
    assert left_running(found[2]) == []


def test_a_child_gone_before_its_kill_is_no_kill_and_no_error():
    """A pool child listed a moment ago may be dead and reaped when its kill comes."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    listed = psutil.Process(child.pid)
    child.kill()
    child.wait()  # reaped: its pid names no process now
    assert kill_if_alive(listed) is False
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert kill_if_alive(psutil.Process(alive.pid)) is True
    assert alive.wait(10) == -9
