"""Why an orchestrator stops before its run is shipped (`rlship orchestrate` names each)."""

from __future__ import annotations

from typing import Any


class RunStateLost(RuntimeError):
    """Redis no longer holds the run (it restarted without persistence, or was flushed)."""

    def __init__(self, run_id: str, report: dict[str, Any]) -> None:
        super().__init__(
            f"run {run_id}: Redis lost the run's state (restarted without persistence?): "
            f"steps {report['steps_lost']} were cut and not yet recorded, "
            f"{len(report['rollouts_lost_pending'])} pending rollouts and "
            f"{len(report['rollouts_lost_in_open_groups'])} in open groups are gone"
        )
        self.report = report


class EmptySteps(RuntimeError):
    """`max_empty_steps` cuts in a row had every rollout dropped by the workers: the run
    cannot make progress with what the producers send."""


class CannotShip(RuntimeError):
    """The run cannot ship at all: its ZMQ ports are another run's, or stayed held past
    `bind_wait_seconds`, or its output directory holds another run's steps, or a disk it
    writes is full (`transport.run_files.DiskFull`)."""


class LeaseLost(RuntimeError):
    """Another orchestrator of the run took the lease: this one stops."""


class RankSilent(RuntimeError):
    """A trainer rank the run waits on has not been heard from for `rank_timeout` seconds
    (orchestrator.rank_watch): dead, hung, or pointed elsewhere."""
