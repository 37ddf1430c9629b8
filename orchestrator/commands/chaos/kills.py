"""The kills of `rlship chaos`: which process dies next, in the rotation the command's
docstring describes, and the record of each."""

from __future__ import annotations

import random
import signal
from collections import Counter
from dataclasses import dataclass

import psutil
import redis

from orchestrator.commands.processes import ProcessGroup
from orchestrator.commands.sentinel_cluster import LocalSentinelCluster
from orchestrator.settings import RunSettings
from tasks.faults import arm, fault_field
from tasks.graph import PER_RANK_STAGES, STAGE_NAMES
from transport.keys import RunKeys

STOCK_STAGES = tuple(stage for stage in STAGE_NAMES if stage != "send")  # see the command's docstring


@dataclass(frozen=True)
class KillPlan:
    ship_kills: int
    stages: tuple[str, ...]
    redis_primary_kills: int = 0
    cluster: LocalSentinelCluster | None = None  # the run's Redis, when its primary is killed


@dataclass
class Kill:
    seconds: float  # since the chaos run started
    target: str  # stage-fault, cpu-worker-child, ship-worker, orchestrator, redis-primary
    stage: str | None = None
    step: int | None = None
    rank: int | None = None
    fired: bool = True  # a stage fault fires when its stage runs; checked at the end


def kill_one(
    settings: RunSettings,
    group: ProcessGroup,
    client: redis.Redis,
    rng: random.Random,
    kills: list[Kill],
    seconds: float,
    plan: KillPlan,
) -> Kill | None:
    """The next kill of the rotation. The orchestrator dies once it has published two
    steps; the Redis primary, if asked, once three are and again every few steps after
    (`plan.redis_primary_kills` in all); the ship worker once four are, and again every few
    steps after (`plan.ship_kills` in all), so all die mid-run."""
    published = client.hlen(RunKeys(settings.run_id).published)
    done = Counter(kill.target for kill in kills)
    if not done["orchestrator"] and published >= 2:
        group.processes["orchestrator"].send_signal(signal.SIGKILL)
        return Kill(seconds, "orchestrator", step=published)
    if plan.cluster is not None and done["redis-primary"] < plan.redis_primary_kills:
        every = max(1, (settings.steps - 3) // plan.redis_primary_kills)
        if published >= 3 + every * done["redis-primary"]:
            plan.cluster.fail_over()  # returns once the killed server is a replica again
            return Kill(seconds, "redis-primary", step=published)
    spacing = max(1, (settings.steps - 4) // max(1, plan.ship_kills))
    if done["ship-worker"] < plan.ship_kills and published >= 4 + spacing * done["ship-worker"]:
        children = _children(group, "ship-worker")  # before: once the parent dies they move
        group.processes["ship-worker"].send_signal(signal.SIGKILL)
        for child in children:
            kill_if_alive(child)
        return Kill(seconds, "ship-worker", step=published)
    if len(kills) % 2 == 0:
        children = _children(group, "cpu-worker")
        if not children or not kill_if_alive(rng.choice(children)):
            return None
        return Kill(seconds, "cpu-worker-child")
    step = int(client.get(RunKeys(settings.run_id).next_step) or settings.start_step)
    if step >= settings.step_numbers.stop:
        return None
    stage = rng.choice(plan.stages)
    rank = rng.randrange(settings.ranks) if stage in PER_RANK_STAGES else None
    if client.hexists(RunKeys(settings.run_id).faults, fault_field(stage, step, rank)):
        return None  # armed already: one fault per stage of a step
    arm(client, settings.run_id, stage, step, rank)
    return Kill(seconds, "stage-fault", stage, step, rank)


def kill_if_alive(process: psutil.Process) -> bool:
    """SIGKILL `process`; False if it is already gone. A pool child listed a moment ago may
    have died since (a stage fault kills its own process) and been reaped by its worker."""
    try:
        process.kill()
    except psutil.NoSuchProcess:
        return False
    return True


def _children(group: ProcessGroup, name: str) -> list[psutil.Process]:
    try:
        return psutil.Process(group.processes[name].pid).children()
    except psutil.NoSuchProcess:
        return []
