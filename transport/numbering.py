"""Step numbers and policy versions, in one place.

A run numbers its training steps from `first_step` (prime-rl counts from 1; rlship's own
trainer can count from 0) and may start later than that (`start_step`, a trainer resumed
from a checkpoint). A policy version is the number of steps trained, counted as prime-rl
counts them: its trainer announces version s after training its step s, version 0 at
start-up. The policy gate ships a step once the trainers' version has reached
`required_version`, the rule prime-rl's orchestrator applies to its (1-indexed) step.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

# A policy version, or an array of them (a cohort's column).
Version = TypeVar("Version", int, np.ndarray)

PRIME_RL_FIRST_STEP = 1


def version_after(step: int, first_step: int) -> int:
    """The policy version a trainer holds once it has trained `step`."""
    return step - first_step + 1


def step_reaching(version: int, first_step: int) -> int:
    """The step whose training raises the trainers' policy version to `version`."""
    return version + first_step - 1


def required_version(step: int, first_step: int, max_async_level: int) -> int:
    """The lowest policy version with which `step` may ship: the step prime-rl numbers
    s = `version_after(step)` waits for version s - 1 - max_async_level."""
    return version_after(step, first_step) - 1 - max_async_level


def staleness(step: int, policy_version: Version, first_step: int) -> Version:
    """How many steps off-policy a rollout generated with `policy_version` is when trained
    at `step`: prime-rl's (s - 1 - v) for its step s = `version_after(step)`. With
    first_step 0 this is `step - policy_version`."""
    return version_after(step, first_step) - 1 - policy_version
