"""The synthetic workloads draw only envs the run takes: its `envs`, else the envs its
per-env group sizes name (a run with `--group-size math=4` and no `--envs` used to crash the
episodes producer on its first `chat` group), else the default three."""

from __future__ import annotations

from orchestrator.commands.produce import SyntheticWorkload
from orchestrator.settings import RunSettings


def test_the_rollouts_workload_draws_the_runs_envs():
    workload = SyntheticWorkload.for_run(RunSettings(run_id="w", envs=["code"], group_size=2))
    assert {record.env for _ in range(10) for record, _ in workload.group()} == {"code"}


def test_the_episodes_workload_draws_the_envs_its_group_sizes_name():
    from rlship.verifiers.produce import workload_envs
    from rlship.verifiers.synthetic import SyntheticEpisodes

    settings = RunSettings(run_id="w", group_size={"math": 4})
    synthetic = SyntheticEpisodes("w", 0, settings.group_size, workload_envs(settings))
    groups = [synthetic.group(0) for _ in range(10)]
    assert all(len(group) == 4 for group in groups)
    assert {episode.env.name for group in groups for episode in group} == {"math"}
