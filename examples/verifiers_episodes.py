"""prime-rl's environment servers' episodes into rlship (docs/integrators.md, "From prime-rl's
environment servers"): where prime-rl's orchestrator hands each completed group of verifiers
v1 episodes to its train sink, hand it to rlship's `EpisodeProducer` instead. rlship makes
the samples prime-rl 559b447's train sink would (one per trainable branch, forks trained
once, per-token credit, loss streams, routed experts) and ships them to the trainer ranks.

Needs the verifiers extra (`pip install -e ".[verifiers]"`). From a checkout, with a Redis at
REDIS_URL (default redis://127.0.0.1:6379/0):

    python examples/verifiers_episodes.py --steps 3

No model runs here: the episodes are built with verifiers' own classes, random tokens
standing in for what an environment server's renderer client records (`EnvClient.run`
returns such an episode). Each group is sent as the msgpack bytes verifiers' serve
encoding makes of it, as they would arrive from a server. Everything the example starts it
stops again by PID; it exits 0 once every rank has every step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import verifiers.v1 as vf
from own_loop import announce, start_rlship, train_with_rlship_receiver
from verifiers.v1.serve.delta import dump, pack

from rlship import AdmissionRefused, RunSettings, connect_redis
from rlship.verifiers import EpisodeProducer

# -- what your environment servers return ------------------------------------------------------


def node(rng: np.random.Generator, message: vf.Message, tokens: int, parent: int | None, sampled: bool):
    """One message of the graph with its tokens; a sampled one's completion is trained (its
    mask) and carries the sampler's logprobs."""
    mask = [sampled and i > 0 for i in range(tokens)]  # the first token: the generation prompt
    return vf.MessageNode(
        message=message,
        token_ids=rng.integers(0, 32_000, size=tokens).tolist(),
        mask=mask,
        logprobs=(-rng.random(sum(mask))).tolist(),
        sampled=sampled,
        parent=parent,
    )


def tool_trace(rng: np.random.Generator, task: int) -> vf.Trace:
    """A multi-turn agent: prompt, a tool call, the tool's result, then either an answer or,
    forked from the same turn, a retry (two branches sharing the first turn)."""
    nodes = [node(rng, vf.UserMessage(content="solve"), 12, None, False)]
    nodes.append(node(rng, vf.AssistantMessage(content="call"), 10, 0, True))
    nodes.append(node(rng, vf.ToolMessage(content="42", tool_call_id="c1"), 6, 1, False))
    nodes.append(node(rng, vf.AssistantMessage(content="answer"), 14, 2, True))
    if rng.random() < 0.5:
        nodes.append(node(rng, vf.UserMessage(content="again"), 4, 1, False))
        nodes.append(node(rng, vf.AssistantMessage(content="retry"), 9, 4, True))
    return vf.Trace(
        task=vf.TraceTask(type="Task", data=vf.TaskData(idx=task, prompt=None), key=f"task-{task}"),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name="solver"),
        nodes=nodes,
        rewards={"correct": vf.Reward(score=float(rng.random() < 0.5))},
        ok=rng.random() > 0.1,  # now and then a provider error: prime-rl drops the trace
        is_completed=True,
        stop_condition="agent_completed",
    )


def episode_group(rng: np.random.Generator, run_id: str, group: str, size: int, version: int) -> list[bytes]:
    """One task's group of `size` episodes, as an environment server sends each (msgpack)."""
    task = int(rng.integers(0, 1000))
    episodes = []
    for _ in range(size):
        trace = tool_trace(rng, task)
        episodes.append(
            vf.Episode(
                env=vf.EnvInfo(id="tool-use", name="tools"),
                task=trace.task,
                group=vf.GroupInfo(id=group),
                run=vf.TrainRunInfo(
                    id=run_id,
                    work=vf.TrainWorkInfo(step=version, policy=vf.PolicySpan(start=version, end=version)),
                ),
                ok=trace.ok,
                traces=[trace],
            )
        )
    return [pack(dump(episode)) for episode in episodes]


# -- your orchestrator's train sink, pointed at rlship ----------------------------------------


def episode_loop(redis_url: str, run_id: str, stop: threading.Event) -> None:
    """Hand each completed group of episodes to rlship while the run admits them."""
    producer = EpisodeProducer.for_run(connect_redis(redis_url), run_id, wait=60, temperature=1.0)
    run = producer.rollouts.settings
    rng = np.random.default_rng(run.seed)
    groups = 0
    while not stop.is_set():
        episodes = episode_group(
            rng, run_id, f"g{groups}", run.group_size, producer.rollouts.policy_version()
        )
        try:
            producer.produce(episodes, timeout=1.0)
        except AdmissionRefused as refused:
            if refused.reason == "finished":
                break
            if refused.passes:
                continue
            raise
        groups += 1
    print(f"episodes: {groups} groups; traces that trained nothing: {producer.errored_traces} errored")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--zmq-port", type=int, default=5555)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/verifiers-episodes"))
    parser.add_argument("--run-id", default=f"episodes-{uuid.uuid4().hex[:6]}")
    args = parser.parse_args()
    settings = RunSettings(
        run_id=args.run_id,
        redis_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        steps=args.steps,
        ranks=2,
        trainers="external",
        zmq_port=args.zmq_port,
        batch_size=16,
        group_size=4,  # episodes a group, as prime-rl's env group_size
        seq_len=512,
        output_dir=args.output_dir.resolve(),
    )
    announce(settings, 0)
    rlship_side = start_rlship(settings, settings.output_dir / "logs")
    got: dict[int, list[int]] = {rank: [] for rank in range(settings.ranks)}
    ranks = [
        threading.Thread(target=train_with_rlship_receiver, args=(settings, rank, got), daemon=True)
        for rank in range(settings.ranks)
    ]
    stop = threading.Event()
    producer = threading.Thread(
        target=episode_loop, args=(settings.redis_url, settings.run_id, stop), daemon=True
    )
    try:
        for thread in [*ranks, producer]:
            thread.start()
        for thread in ranks:
            thread.join(timeout=120)
        shipped = rlship_side[-1].wait(timeout=60) == 0
    finally:
        stop.set()
        for process in rlship_side:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in rlship_side:
            process.wait(timeout=30)
        producer.join(timeout=10)
        queues = (settings.cpu_queue, settings.ship_queue)
        connect_redis(settings.redis_url).delete(
            *queues, *(f"_kombu.binding{kind}.{queue}" for kind in ("", "_permanent") for queue in queues)
        )
    for rank, steps in got.items():
        print(f"rank {rank}: received steps {steps}")
    complete = shipped and all(steps == list(settings.step_numbers) for steps in got.values())
    verdict = "every rank got every step" if complete else "INCOMPLETE"
    print(f"verifiers episodes, run {settings.run_id}: {verdict}")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
