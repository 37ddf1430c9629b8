"""verifiers v1 episodes built with verifiers 0.4.0's own classes (`MessageNode`, `Trace`,
`Episode`, ...) as prime-rl's tests build them (tests/unit/orchestrator/test_advantage.py at
559b447): no model and no hand-written dicts. Token ids, logprobs and routing are drawn
from a seeded generator, so each kind is the same for every run of a test.

The kinds: single-turn, multi-turn with tool messages, forked (two branches sharing a
sampled prefix turn), multimodal (image placeholders in the trace's token-type map), MoE
(routed experts on every node), a trace of a non-trainable agent beside a trainable one,
an errored trace, per-token advantages and loss-weight streams assigned by a user's
algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import verifiers.v1 as vf

IMAGE_TOKEN = 151_655  # an image placeholder id (Qwen-VL's), marked 1 in the token-type map
LAYERS, TOPK = 4, 2


class TraceBuilder:
    """Appends nodes to a trace's graph; each node's tokens, mask, logprobs drawn at random."""

    def __init__(self, rng: np.random.Generator, routed: bool = False) -> None:
        self.rng = rng
        self.routed = routed
        self.nodes: list[vf.MessageNode] = []
        self.calls: list[vf.ModelCall] = []

    def _tokens(self, count: int, image: bool = False) -> list[int]:
        ids = self.rng.integers(0, 30_000, size=count).tolist()
        if image:
            ids[1:3] = [IMAGE_TOKEN, IMAGE_TOKEN]
        return ids

    def add(self, message: vf.Message, count: int, parent: int | None, sampled: bool = False, **extra) -> int:
        """A node of `count` tokens after `parent`; a sampled one's first token is scaffold
        (the generation prompt), the rest sampled."""
        ids = self._tokens(count, image=extra.pop("image", False))
        mask = [sampled and i > 0 for i in range(count)]
        logprobs = (-self.rng.random(sum(mask))).tolist() if sampled else []
        experts = (
            self.rng.integers(0, 64, size=(count, LAYERS, TOPK), dtype=np.uint8) if self.routed else None
        )
        self.nodes.append(
            vf.MessageNode(
                message=message,
                token_ids=ids,
                mask=mask,
                logprobs=logprobs,
                sampled=sampled,
                parent=parent,
                routed_experts=experts,
                **extra,
            )
        )
        index = len(self.nodes) - 1
        if sampled:
            self.calls.append(
                vf.ModelCall(node=index, usage=vf.Usage(prompt_tokens=count, completion_tokens=sum(mask)))
            )
        return index

    def prompt(self, count: int = 6, image: bool = False) -> int:
        return self.add(vf.UserMessage(content="q"), count, None, image=image)

    def turn(self, parent: int, count: int = 5, **extra) -> int:
        return self.add(vf.AssistantMessage(content="a"), count, parent, sampled=True, **extra)

    def tool(self, parent: int, count: int = 4) -> int:
        return self.add(vf.ToolMessage(content="t", tool_call_id="call-1"), count, parent)

    def trace(
        self,
        reward: float,
        task_index: int = 0,
        agent: str = "solver",
        trainable: bool = True,
        ok: bool = True,
        metrics: dict[str, float] | None = None,
        mm_map: dict[int, int] | None = None,
        stop: str = "agent_completed",
    ) -> vf.Trace:
        trace = vf.Trace[vf.TaskData](
            task=vf.TraceTask(
                type="Task", data=vf.TaskData(idx=task_index, prompt=None), key=f"task-{task_index}"
            ),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name=agent, trainable=trainable),
            nodes=self.nodes,
            calls=self.calls,
            rewards={"reward": vf.Reward(score=reward)},
            metrics=metrics or {"turns_used": float(sum(node.sampled for node in self.nodes))},
            mm_token_type_id_map=mm_map or {},
            ok=ok,
            is_completed=True,
            stop_condition=stop,
        )
        if not ok:
            trace.errors.append(vf.Error(type="ProviderError", message="upstream 503"))
        return trace


def episode(
    traces: Sequence[vf.Trace],
    group: str,
    env: str = "math",
    run_id: str = "run",
    version: int = 0,
) -> vf.Episode:
    return vf.Episode(
        env=vf.EnvInfo(id=env, name=env),
        task=traces[0].task,
        group=vf.GroupInfo(id=group),
        run=vf.TrainRunInfo(
            id=run_id, work=vf.TrainWorkInfo(step=version, policy=vf.PolicySpan(start=version, end=version))
        ),
        ok=all(trace.ok for trace in traces),
        traces=list(traces),
    )


def single_turn(rng: np.random.Generator, reward: float, routed: bool = False) -> vf.Trace:
    build = TraceBuilder(rng, routed)
    build.turn(build.prompt(), count=8)
    return build.trace(reward)


def multi_turn_tools(rng: np.random.Generator, reward: float, routed: bool = False) -> vf.Trace:
    """prompt, turn, tool result, turn, tool result, turn."""
    build = TraceBuilder(rng, routed)
    at = build.turn(build.prompt())
    at = build.turn(build.tool(at), count=6)
    build.turn(build.tool(at, count=3), count=7)
    return build.trace(reward, stop="max_turns")


def forked(rng: np.random.Generator, reward: float, routed: bool = False) -> vf.Trace:
    """A sampled turn shared by two branches (a mid-trajectory fork): trained in the first."""
    build = TraceBuilder(rng, routed)
    shared = build.turn(build.prompt())
    build.turn(build.tool(shared), count=6)
    build.turn(build.add(vf.UserMessage(content="retry"), 3, shared), count=4)
    return build.trace(reward)


def multimodal(rng: np.random.Generator, reward: float, routed: bool = False) -> vf.Trace:
    build = TraceBuilder(rng, routed)
    build.turn(build.prompt(count=8, image=True), count=6)
    return build.trace(reward, mm_map={IMAGE_TOKEN: 1})


def judged(rng: np.random.Generator, reward: float, routed: bool = False) -> list[vf.Trace]:
    """A solver's single-turn trace beside a judge's: the judge agent does not train."""
    judge = TraceBuilder(rng, routed)
    judge.turn(judge.prompt())
    return [single_turn(rng, reward, routed), judge.trace(0.0, agent="judge", trainable=False)]


def errored(rng: np.random.Generator, routed: bool = False) -> vf.Trace:
    """A trace whose provider failed mid-turn (ok False, an error recorded)."""
    build = TraceBuilder(rng, routed)
    build.turn(build.prompt())
    return build.trace(0.0, ok=False)


def with_advantages(trace: vf.Trace, advantages: Sequence[float]) -> vf.Trace:
    """A user's algorithm's per-token credit over the trace's sampled tokens in node order
    (as prime-rl's `assign_advantages` lays it out)."""
    at = 0
    for node in trace.nodes:
        sampled = sum(node.mask)
        if sampled:
            node.advantages = [float(value) for value in advantages[at : at + sampled]]
            at += sampled
    return trace


def with_loss_weights(trace: vf.Trace, streams: Sequence[str] = ("ce", "ref_kl")) -> vf.Trace:
    """Loss-weight streams on every sampled node (0.5 on its sampled tokens)."""
    for node in trace.nodes:
        if any(node.mask):
            node.loss_weights = {name: [0.5 if m else 0.0 for m in node.mask] for name in streams}
    return trace
