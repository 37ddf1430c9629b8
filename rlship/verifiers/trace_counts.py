"""A trace's own counts for its rollouts' records (`RolloutRecord.trace`): what verifiers
0.4.0's `Trace` properties give (`num_input_tokens`, `num_output_tokens`,
`num_total_tokens`, `num_branches`), from its branches built once (each of those properties
builds them anew: four times the conversion's cost of a forked trace)."""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from verifiers.v1.trace import min_new_input_tokens


def trace_counts(trace: vf.Trace, trace_id: str) -> dict[str, Any]:
    """`trace`'s id and counts: new input tokens of each model call once however many
    branches share it, output tokens once per branch, total as input plus every call's
    completion once, one branch per leaf."""
    branches = trace.branches
    new_input: dict[int, int] = {}
    for branch in branches:
        for call, tokens in min_new_input_tokens(branch.calls):
            new_input.setdefault(id(call), tokens)
    input_tokens = sum(new_input.values())
    usage = trace.usage
    return {
        "id": trace_id,
        "num_input_tokens": input_tokens,
        "num_output_tokens": sum(branch.num_output_tokens for branch in branches),
        "num_total_tokens": input_tokens + (usage.completion_tokens if usage is not None else 0),
        "num_branches": len(branches),
    }
