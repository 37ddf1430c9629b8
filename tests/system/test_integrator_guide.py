"""docs/integrators.md runs as written: its code blocks, read from the page as it stands,
run as the page says. The first bash block's variables are the run's (this test gives the
run its own id, Redis, port and directory; every other value is the page's); the bash
blocks above "Receiving steps" start rlship's side, each in a shell of its own; the
Python blocks outside that section are the producer, one program; the block in it is
each rank's program, run once per rank with RANK set. Every step reaches every rank (each
rank's own output, and its acknowledgements in Redis), the producer prints the output the
page shows, the workers are stopped as the page says (Ctrl-C), the page's last blocks
clean up after them, and the run leaves no process, no key without an expiry, no queue."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from itertools import pairwise
from pathlib import Path

import pytest

from orchestrator.commands.processes import delete_queues
from orchestrator.settings import run_queue
from tests.support.markdown_blocks import CodeBlock, code_blocks
from tests.support.processes import REPO, left_running, session_queue
from transport.keys import RunKeys
from transport.store import PayloadStore
from transport.zmq_sockets import free_port_pair

GUIDE = REPO / "docs" / "integrators.md"
RANK_SECTION = "Receiving steps on the trainer ranks"
RUN_SECONDS = 90  # the page's run, from its first block to every rank's last step
STOP_SECONDS = 20


def page_variables(block: CodeBlock, cwd: Path) -> dict[str, str]:
    """The variables the page's first bash block exports, as bash sets them."""
    names = re.findall(r"^export (\w+)=", block.text, re.MULTILINE)
    assert names, f"{GUIDE}:{block.line}: the first bash block sets no variables"
    shown = subprocess.run(
        ["bash", "-euc", block.text + 'for name in "$@"; do printf "%s\\0" "${!name}"; done', "bash", *names],
        cwd=cwd, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(zip(names, shown.stdout.split("\0")[:-1], strict=True))


def start(command: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    """A process in a session of its own (a terminal's), so a Ctrl-C reaches all it started."""
    return subprocess.Popen(
        command, env=env, cwd=cwd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(process: subprocess.Popen, sig: signal.Signals = signal.SIGINT) -> None:
    """Send `sig` to the process's session by its PID (as Ctrl-C does), SIGKILL if it stays."""
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def ended(process: subprocess.Popen, log: Path, timeout: float) -> None:
    """The process exits 0 within `timeout` s; if not, the failure shows the last lines of
    every process's log (a run held up shows why in another's)."""
    try:
        process.wait(timeout)
        problem = f"exited {process.returncode}" if process.returncode else ""
    except subprocess.TimeoutExpired:
        problem = f"still running after {timeout:.0f} s"
    if problem:
        tails = "".join(f"\n== {other.name}\n{tail(other)}" for other in sorted(log.parent.iterdir()))
        pytest.fail(f"{log.stem}: {process.args} {problem}{tails}")


def tail(log: Path, lines: int = 8) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@pytest.mark.timeout(180)
def test_every_code_block_of_the_guide_runs_as_written(client, redis_url, tmp_path):
    blocks = code_blocks(GUIDE)
    languages = {block.language for block in blocks}
    assert languages <= {"bash", "python", "text"}, f"a block that neither runs nor shows output: {languages}"
    bash = [block for block in blocks if block.language == "bash"]
    (rank_block,) = [b for b in blocks if b.language == "python" and b.section == RANK_SECTION]
    producer_blocks = [b for b in blocks if b.language == "python" and b.section != RANK_SECTION]
    # A text block right after a producer block is that block's output.
    shown = [
        after.text
        for block, after in pairwise(blocks)
        if block in producer_blocks and after.language == "text"
    ]
    run_id = f"guide-{uuid.uuid4().hex[:8]}"
    keys = RunKeys(run_id)
    queues = [session_queue(run_queue(run_id, kind)) for kind in ("cpu", "ship")]
    variables = page_variables(bash[0], tmp_path)
    own = {
        "REDIS_URL": redis_url,
        "RLSHIP_RUN_ID": run_id,
        "RLSHIP_ZMQ_PORT": str(free_port_pair()),
        "RLSHIP_OUTPUT_DIR": str(tmp_path / "run"),
    }
    assert own.keys() <= variables.keys(), "the page's first block names the run's variables"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # rlship's environment
        "PYTHONPATH": str(REPO),
        **variables,
        **own,
    }
    steps, ranks = int(variables["RLSHIP_STEPS"]), int(variables["RLSHIP_RANKS"])
    logs = tmp_path / "logs"
    logs.mkdir()
    (tmp_path / "producer.py").write_text("\n".join(block.text for block in producer_blocks))
    (tmp_path / "rank.py").write_text(rank_block.text)

    started: dict[str, tuple[subprocess.Popen, Path]] = {}

    def run(name: str, command: list[str], cwd: Path, **extra: str) -> tuple[subprocess.Popen, Path]:
        log = logs / f"{name}.log"
        started[name] = start(command, {**env, **extra}, cwd, log), log
        return started[name]

    try:
        rlship_side = [b for b in bash[1:] if b.line < rank_block.line]
        for block in rlship_side:
            run(f"bash-{block.line}", ["bash", "-euc", block.text], REPO)
        producer = run("producer", [sys.executable, str(tmp_path / "producer.py")], tmp_path)
        ranks_started = [
            run(f"rank-{rank}", [sys.executable, str(tmp_path / "rank.py")], tmp_path, RANK=str(rank))
            for rank in range(ranks)
        ]
        for process, log in [*ranks_started, producer]:
            ended(process, log, RUN_SECONDS)
        workers = [started[f"bash-{b.line}"] for b in rlship_side if b.text.startswith("celery ")]
        assert len(workers) == 2, "the page starts a cpu worker and a ship worker"
        for block in rlship_side:
            if not block.text.startswith("celery "):
                ended(*started[f"bash-{block.line}"], STOP_SECONDS)  # the orchestrator exits 0
        for process, _ in workers:
            stop(process)  # Ctrl-C, as the page says
        for block in [b for b in bash[1:] if b.line > rank_block.line]:
            ended(*run(f"bash-{block.line}", ["bash", "-euc", block.text], REPO), STOP_SECONDS)

        for rank in range(ranks):
            output = started[f"rank-{rank}"][1].read_text()
            got = [int(step) for step in re.findall(rf"^rank {rank}: step (\d+),", output, re.MULTILINE)]
            assert got == list(range(1, steps + 1)), output
            acknowledged = sorted(int(step) for step in client.hkeys(keys.received(rank)))
            assert acknowledged == list(range(1, steps + 1)), f"rank {rank} acknowledged {acknowledged}"
        printed = producer[1].read_text()
        for output in shown:
            assert output in printed, f"the page shows\n{output}\nthe producer printed\n{printed}"
        assert left_running(run_id) == [] and left_running(str(tmp_path)) == []
        unexpiring = [key for key in client.scan_iter(match=f"{keys.prefix}*") if client.ttl(key) == -1]
        assert unexpiring == [], f"keys of the run without an expiry: {unexpiring}"
        bindings = [f"_kombu.binding{kind}.{queue}" for kind in ("", "_permanent") for queue in queues]
        left = [name for name in [*queues, *bindings] if client.exists(name)]
        assert left == [], f"the run's queues are left: {left}"
    finally:
        for process, _ in started.values():
            stop(process, signal.SIGTERM)
        PayloadStore(client, run_id).expire_run(3600)
        delete_queues(client, queues)
