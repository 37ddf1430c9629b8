"""A 50-step soak: the workers' memory stays bounded over a long run (release deletes every
step's keys and trims the heap), and a cpu pool process grown past its limit is replaced
after its task without costing a step. Memory is sampled from the real worker processes
(mains and pool processes) while the steps ship."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable

import psutil
import pytest
import redis

from tests.support.processes import running_workers
from tests.support.shiprun import ship, ship_settings
from transport.keys import RunKeys

pytestmark = pytest.mark.timeout(400)

STEPS = 50
MIB = 1 << 20
CPU_LIMIT_MIB = 256  # well above a pool process's working size (~80 MiB here)
RECYCLE_LIMIT_MIB = 64  # below it: every cpu task ends with its process replaced


class MemorySampler:
    """Every 0.1 s: the RSS of every worker process (mains and pool processes), against the
    number of steps published so far."""

    def __init__(self, workers: Iterable[psutil.Process], client: redis.Redis, run_id: str) -> None:
        self.mains = list(workers)
        self.client = client
        self.published = RunKeys(run_id).published
        self.samples: list[tuple[int, int, int]] = []  # (steps published, total RSS, largest process RSS)
        self.pool_pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            processes = [p for main in self.mains for p in (main, *main.children())]
            self.pool_pids.update(p.pid for main in self.mains for p in main.children())
            sizes = []
            for process in processes:
                try:
                    sizes.append(process.memory_info().rss)
                except psutil.NoSuchProcess:
                    continue
            self.samples.append((self.client.hlen(self.published), sum(sizes), max(sizes, default=0)))

    def peak(self, first_step: int, last_step: int) -> int:
        return max(total for step, total, _ in self.samples if first_step <= step < last_step)


def soak(client, redis_url, run_id, tmp_path, steps: int, limit_mib: int) -> tuple[MemorySampler, int]:
    """Ship `steps` steps with cpu pool processes limited to `limit_mib`; return the
    samples and how many pool processes were seen (more than the 3 started: replacements)."""
    (tmp_path / "workers").mkdir()
    with running_workers(redis_url, tmp_path / "workers", max_memory_mib=limit_mib) as workers:
        settings = ship_settings(
            run_id, redis_url, workers, tmp_path / "run", steps=steps, batch_size=64, seq_len=2048
        )
        mains = [psutil.Process(p.pid) for p in workers.processes.values()]
        with MemorySampler(mains, client, run_id) as sampler:
            result = ship(settings)
    assert result.summary["steps_shipped"] == steps
    return sampler, len(sampler.pool_pids)


def test_worker_memory_stays_bounded_over_a_50_step_soak(client, redis_url, run_id, tmp_path):
    sampler, _ = soak(client, redis_url, run_id, tmp_path, STEPS, CPU_LIMIT_MIB)
    early, late = sampler.peak(5, 15), sampler.peak(STEPS - 10, STEPS + 1)
    report = {
        "early_peak_mib": round(early / MIB, 1),
        "late_peak_mib": round(late / MIB, 1),
        "largest_process_mib": round(max(s[2] for s in sampler.samples) / MIB, 1),
    }
    (tmp_path / "soak.json").write_text(json.dumps(report, indent=1))
    print(f"soak: {report}")
    assert late <= early * 1.10 + 16 * MIB, f"worker memory grew over the soak: {report}"


def test_a_cpu_process_past_its_memory_limit_is_replaced_and_the_steps_still_ship(
    client, redis_url, run_id, tmp_path
):
    _, pool_processes = soak(client, redis_url, run_id, tmp_path, 4, RECYCLE_LIMIT_MIB)
    assert pool_processes > 3, "no cpu pool process was replaced"
