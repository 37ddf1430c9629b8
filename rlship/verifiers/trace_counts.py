"""A trace's own counts for its rollouts' records (`RolloutRecord.trace`): what verifiers
0.4.0's `Trace` properties give (`num_input_tokens`, `num_output_tokens`,
`num_total_tokens`, `num_branches`), in one walk of its leaves' paths (each of those
properties builds every `Branch` anew: four times the conversion's cost of a forked trace)."""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from verifiers.v1.graph import leaves
from verifiers.v1.trace import min_new_input_tokens


def trace_counts(trace: vf.Trace, trace_id: str) -> dict[str, Any]:
    """`trace`'s id and counts: new input tokens of each model call once however many
    branches share it, output tokens once per branch, total as input plus every call's
    completion once, one branch per leaf."""
    nodes = trace.nodes
    call_of = {call.node: call for call in trace.calls if call.node is not None}
    new_input: dict[int, int] = {}
    output_tokens = 0
    branches = leaves(trace)
    for leaf in branches:
        path: list[vf.ModelCall] = []  # the branch's calls, leaf to root
        node: int | None = leaf
        while node is not None:
            if node in call_of:
                path.append(call_of[node])
            node = nodes[node].parent
        path.reverse()
        for call, tokens in min_new_input_tokens(path):
            new_input.setdefault(id(call), tokens)
        output_tokens += sum(call.usage.completion_tokens for call in path if call.usage is not None)
    input_tokens = sum(new_input.values())
    completion = sum(call.usage.completion_tokens for call in trace.calls if call.usage is not None)
    return {
        "id": trace_id,
        "num_input_tokens": input_tokens,
        "num_output_tokens": output_tokens,
        "num_total_tokens": input_tokens + completion,
        "num_branches": len(branches),
    }
