"""Synthetic verifiers episodes: what `rlship run --workload episodes` produces. Seeded groups
built with verifiers 0.4.0's own classes (no model): multi-turn agents calling tools, some
forking a turn (two branches sharing it), a judge agent that does not train beside some,
now and then a provider error; and some groups whose algorithm assigned per-token
advantages (the others get prime-rl's GRPO from the producer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import verifiers.v1 as vf

from orchestrator.commands.produce import DEFAULT_ENVS
from orchestrator.groups import group_size_of

ERROR_RATE = 0.03
FORK_RATE = 0.3
JUDGE_RATE = 0.2
GIVEN_CREDIT_RATE = 0.25


@dataclass
class SyntheticEpisodes:
    """Seeded groups of episodes for a run (its envs, group sizes, seq_len and vocabulary)."""

    run_id: str
    seed: int = 0
    group_size: int | Mapping[str, int] = 8
    envs: tuple[str, ...] = DEFAULT_ENVS
    seq_len: int = 2048
    vocab_size: int = 151_936
    rng: np.random.Generator = field(init=False)
    groups: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def group(self, version: int) -> list[vf.Episode]:
        """The next task's group: its env's group size of episodes sampled by `version`."""
        env = str(self.rng.choice(self.envs))
        task = int(self.rng.integers(0, 100_000))
        name = f"ep{self.seed}-{self.groups}"
        self.groups += 1
        episodes = [
            self._episode(env, name, task, version) for _ in range(group_size_of(self.group_size, env))
        ]
        if self.rng.random() < GIVEN_CREDIT_RATE:
            self._assign_credit(episodes)
        return episodes

    def _episode(self, env: str, group: str, task: int, version: int) -> vf.Episode:
        traces = [self._trace(task, "solver", trainable=True)]
        if self.rng.random() < JUDGE_RATE:
            traces.append(self._trace(task, "judge", trainable=False))
        return vf.Episode(
            env=vf.EnvInfo(id=env, name=env),
            task=traces[0].task,
            group=vf.GroupInfo(id=group),
            run=vf.TrainRunInfo(
                id=self.run_id,
                work=vf.TrainWorkInfo(step=version, policy=vf.PolicySpan(start=version, end=version)),
            ),
            ok=all(trace.ok for trace in traces),
            traces=traces,
        )

    def _trace(self, task: int, agent: str, trainable: bool) -> vf.Trace:
        """Prompt, then turns each followed by a tool's result, within a quarter of seq_len a
        branch; a fork retries from the first turn."""
        budget = max(16, self.seq_len // 4)
        nodes = [self._node(vf.UserMessage(content="task"), int(budget * 0.2), None, sampled=False)]
        turns = int(self.rng.integers(1, 4))
        for turn in range(turns):
            nodes.append(self._node(vf.AssistantMessage(content="a"), int(budget * 0.15), len(nodes) - 1))
            if turn < turns - 1:
                tool = vf.ToolMessage(content="result", tool_call_id=f"call-{turn}")
                nodes.append(self._node(tool, int(budget * 0.1), len(nodes) - 1, sampled=False))
        if turns > 1 and self.rng.random() < FORK_RATE:
            nodes.append(self._node(vf.UserMessage(content="retry"), 4, 1, sampled=False))
            nodes.append(self._node(vf.AssistantMessage(content="b"), int(budget * 0.15), len(nodes) - 1))
        ok = bool(self.rng.random() >= ERROR_RATE)
        trace = vf.Trace(
            task=vf.TraceTask(type="Task", data=vf.TaskData(idx=task, prompt=None), key=f"task-{task}"),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name=agent, trainable=trainable),
            nodes=nodes,
            rewards={"correct": vf.Reward(score=float(self.rng.random() < 0.5))},
            metrics={"turns": float(turns)},
            ok=ok,
            is_completed=True,
            stop_condition="agent_completed" if ok else "model_error",
        )
        if not ok:
            trace.errors.append(vf.Error(type="ProviderError", message="upstream 503 (synthetic)"))
        return trace

    def _node(
        self, message: vf.Message, most: int, parent: int | None, sampled: bool = True
    ) -> vf.MessageNode:
        tokens = int(self.rng.integers(max(2, most // 2), max(3, most + 1)))
        mask = [sampled and i > 0 for i in range(tokens)]
        return vf.MessageNode(
            message=message,
            token_ids=self.rng.integers(0, self.vocab_size, size=tokens).tolist(),
            mask=mask,
            logprobs=(-self.rng.random(sum(mask))).tolist(),
            sampled=sampled,
            parent=parent,
        )

    def _assign_credit(self, episodes: list[vf.Episode]) -> None:
        """A user's algorithm's per-token credit: the reward's sign, decaying along the turns."""
        for episode in episodes:
            for trace in episode.traces:
                sign = 1.0 if trace.reward > 0 else -1.0
                for depth, node in enumerate(n for n in trace.nodes if any(n.mask)):
                    node.advantages = [sign * 0.9**depth] * sum(node.mask)
