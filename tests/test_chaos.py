"""`rlship chaos` end to end: a short seeded run while workers, the ship worker and the
orchestrator are killed, compared with a fault-free run of the same workload."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO, python_command

pytestmark = pytest.mark.timeout(400)


def test_chaos_delivers_every_step_once_in_order_and_identical(tmp_path):
    path = tmp_path / "chaos.json"
    done = subprocess.run(
        python_command(
            "chaos", "--steps", "8", "--kill-every", "0.2", "--timeout", "150", "--json", str(path)
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=380,
    )
    report = json.loads(path.read_text())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert report["goal_met"]
    assert report["steps_delivered_per_rank"] == {"0": 8, "1": 8}
    assert report["duplicates_delivered"] == report["out_of_order"] == report["payload_mismatches"] == 0
    assert report["records_published"] == 8 and report["keys_left"] == 0
    assert report["kills"] >= 10
    assert {"orchestrator", "ship-worker", "stage-fault"} <= set(report["kills_by_target"])
    assert "goal MET" in done.stdout


def test_chaos_with_stock_receivers_reports_no_duplicate_and_no_hang(tmp_path):
    """Ranks that receive as prime-rl's do (READY once, no duplicate check, no replay),
    the ship worker killed twice among the other kills."""
    path = tmp_path / "chaos.json"
    # What an earlier invocation with the same --json left: its ranks' records of step 1.
    for name in ("reference", "chaos"):
        earlier = tmp_path / name / "stock" / "rank-0.jsonl"
        earlier.parent.mkdir(parents=True)
        earlier.write_text(json.dumps({"step": 1, "topic_step": 1, "sha256": "0" * 64}) + "\n")
    done = subprocess.run(
        python_command(
            "chaos", "--steps", "8", "--kill-every", "0.2", "--timeout", "150", "--json", str(path),
            "--receivers", "stock", "--ship-kills", "2",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=380,
    )  # fmt: skip
    report = json.loads(path.read_text())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert report["goal_met"] and report["receivers"] == "stock"
    assert report["steps_delivered_per_rank"] == {"0": 8, "1": 8}
    assert report["duplicates_delivered"] == report["out_of_order"] == report["payload_mismatches"] == 0
    assert report["hung_ranks"] == [] and report["kills_by_target"]["ship-worker"] == 2
    assert "send" not in report["kills_by_stage"], "the send fault fires inside the window by design"
