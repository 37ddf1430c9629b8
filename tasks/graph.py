"""The ship path's stage graph, as data: the one place that says which stages there are,
which run once per rank, on which queue, and what follows each.

    finalize -> prune -> metrics ----------------------------.
                      -> pack -> encode[rank] -> send[rank] --+-> publish -> release

A stage follows a per-rank one for the same rank, or (a per-step stage) once every rank
is done: the fan-in. Prune and pack are *carried*: they run in the task of the stage before
them, in the same process, right after it (each still marked, timed and traced as a stage):
two hops fewer between the cut and the first encode. The stage tasks (`tasks.stage_task`)
run or enqueue successors from it, `rlship run`'s progress display counts the stages in
flight from it, and `rlship chaos` picks the stage to kill in from it. Pure data: importing
it starts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Stage:
    name: str
    per_rank: bool  # one task per trainer rank, with the rank as its third argument
    queue: Literal["cpu", "ship"]  # the run's `cpu_queue` or its one ship worker's `ship_queue`
    then: tuple[str, ...]  # the stages that follow it
    # Whether it leaves a completion mark (`RunKeys.done`); send records its ranks in the
    # step's `sent` set, publish and release the step in run-wide hashes.
    marked: bool = True
    # Enqueued by the orchestrator (the first stage; release, once it has followed the
    # record), not by the stage before it.
    by_orchestrator: bool = False
    # Run by the task of its one predecessor, in its process, once that is done (no task of
    # its own: a message, a queue wait and a read of what the predecessor wrote less).
    carried: bool = False

    @property
    def task_name(self) -> str:
        """The Celery task's name: in every task message and in Flower, so it never changes."""
        return f"rlship.{self.name}"


STAGES = (
    Stage("finalize", per_rank=False, queue="cpu", then=("prune",), by_orchestrator=True),
    Stage("prune", per_rank=False, queue="cpu", then=("metrics", "pack"), carried=True),
    Stage("metrics", per_rank=False, queue="cpu", then=("publish",)),
    Stage("pack", per_rank=False, queue="cpu", then=("encode",), carried=True),
    Stage("encode", per_rank=True, queue="cpu", then=("send",)),
    Stage("send", per_rank=True, queue="ship", then=("publish",), marked=False),
    Stage("publish", per_rank=False, queue="cpu", then=("release",), marked=False),
    Stage("release", per_rank=False, queue="cpu", then=(), marked=False, by_orchestrator=True),
)
STAGE = {stage.name: stage for stage in STAGES}
STAGE_NAMES = tuple(STAGE)
PER_RANK_STAGES = tuple(stage.name for stage in STAGES if stage.per_rank)
# The stages a step goes through until its record is published (release comes after).
STEP_STAGES = STAGE_NAMES[: STAGE_NAMES.index("publish") + 1]


def predecessors(name: str) -> tuple[Stage, ...]:
    """The stages `name` follows; more than one is a fan-in (it waits for all of them)."""
    return tuple(stage for stage in STAGES if name in stage.then)


def task_stages(name: str) -> tuple[str, ...]:
    """The stages a task of stage `name` runs, in order: it, then those it carries."""
    carried = (STAGE[after] for after in STAGE[name].then)
    return (name, *(inner for stage in carried if stage.carried for inner in task_stages(stage.name)))


def stage_ranks(stage: Stage, ranks: int) -> Sequence[int | None]:
    """The instances of a stage for one step: each rank, or one (None) for a per-step stage."""
    return range(ranks) if stage.per_rank else (None,)


def awaited_ranks(before: Stage, stage: Stage, rank: int | None, ranks: int) -> Sequence[int | None]:
    """The instances of `before` that `stage` (for `rank`) waits for: the one of a per-step
    stage, the same rank between per-rank stages, every rank at a fan-in."""
    if not before.per_rank:
        return (None,)
    return (rank,) if stage.per_rank else range(ranks)
