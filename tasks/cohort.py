"""Cohorts: the scalar observations of a set of rollouts, held column by column.

The orchestrator reduces every finalized rollout to one row of scalars (reward, token
counts, flags, custom metrics) and keeps the rows as compact columns, never as
per-rollout objects; the workers compute exact statistics over the same columns.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from transport.arrays_blob import pack_arrays, unpack_arrays

# Numeric columns every row has. Flags are 0.0/1.0 so rates are plain means.
NUMERIC_COLUMNS: tuple[str, ...] = (
    "reward",
    "advantage",
    "num_input_tokens",
    "num_output_tokens",
    "num_turns",
    "temperature",
    "policy_version",
    "is_truncated",
    "is_trainable",
    "has_error",
    "cancelled",
)
# Text columns every row has ("" when absent).
LABEL_COLUMNS: tuple[str, ...] = (
    "rollout_id", "env", "group_id", "task_id", "error", "stop_condition", "agent",
    "rows_field", "rows_file",  # a producer's facts of side arrays by handle ("" without)
    "episode_id", "trace_id",  # the episode and trace a verifiers branch is of ("" without)
)  # fmt: skip
CUSTOM_PREFIX = "metric/"
# The whole trace's counts of a rollout that is one branch of it (`RolloutRecord.trace`):
# `trace/{name}`, NaN in the rows of rollouts that are not.
TRACE_PREFIX = "trace/"


@dataclass
class Cohort:
    """A table of rollouts: numeric columns (float64) and label columns, equal length.

    Custom per-rollout metrics are numeric columns named `metric/{name}`; a rollout that
    did not report a metric holds NaN there and is left out of that metric's statistics.
    """

    numeric: dict[str, np.ndarray] = field(default_factory=dict)
    labels: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in NUMERIC_COLUMNS:
            self.numeric.setdefault(name, np.zeros(0))
        rows = len(self.labels.get("rollout_id", []))
        for name in LABEL_COLUMNS:  # a column added since a cohort was stored reads as ""
            self.labels.setdefault(name, [""] * rows)
        lengths = {len(v) for v in self.numeric.values()} | {len(v) for v in self.labels.values()}
        if len(lengths) > 1:
            raise ValueError(f"cohort columns have different lengths: {sorted(lengths)}")

    def __len__(self) -> int:
        return len(self.labels["rollout_id"])

    @property
    def custom_metric_names(self) -> list[str]:
        return sorted(n[len(CUSTOM_PREFIX) :] for n in self.numeric if n.startswith(CUSTOM_PREFIX))

    def total_tokens(self) -> np.ndarray:
        """Each rollout's input plus output tokens."""
        return self.numeric["num_input_tokens"] + self.numeric["num_output_tokens"]

    def rewards_by_group(self) -> list[list[float]]:
        """Each group's rewards (a group: a group id of an env), groups as first seen."""
        groups: dict[tuple[str, str], list[float]] = {}
        for env, group, reward in zip(
            self.labels["env"], self.labels["group_id"], self.numeric["reward"], strict=True
        ):
            groups.setdefault((env, group), []).append(float(reward))
        return list(groups.values())

    def take(self, index: np.ndarray | list[int]) -> Cohort:
        """The rows at `index` (a boolean mask or positions), in that order."""
        positions = np.flatnonzero(index) if np.asarray(index).dtype == bool else np.asarray(index, int)
        return Cohort(
            numeric={name: values[positions] for name, values in self.numeric.items()},
            labels={name: [values[i] for i in positions] for name, values in self.labels.items()},
        )

    def where(self, label: str, value: str) -> Cohort:
        return self.take(np.array([v == value for v in self.labels[label]], dtype=bool))

    def with_numeric(self, **columns: np.ndarray) -> Cohort:
        """A copy with extra or replaced numeric columns."""
        return Cohort(numeric={**self.numeric, **columns}, labels=dict(self.labels))

    @classmethod
    def concat(cls, cohorts: Iterable[Cohort]) -> Cohort:
        cohorts = list(cohorts)
        names = sorted({n for c in cohorts for n in c.numeric})
        numeric = {
            n: np.concatenate([c.numeric.get(n, np.full(len(c), np.nan)) for c in cohorts] or [np.zeros(0)])
            for n in names
        }
        labels = {n: [v for c in cohorts for v in c.labels[n]] for n in LABEL_COLUMNS}
        return cls(numeric=numeric, labels=labels)

    def to_wire(self) -> dict[str, Any]:
        return {"numeric": pack_arrays(self.numeric), "labels": self.labels}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Cohort:
        numeric = {n: np.array(v) for n, v in unpack_arrays(data["numeric"]).items()}
        return cls(numeric=numeric, labels={n: list(v) for n, v in data["labels"].items()})

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_wire(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> Cohort:
        return cls.from_wire(msgpack.unpackb(data, raw=False))


class CohortBuilder:
    """Appends rows into compact typed arrays; `build()` snapshots them as a Cohort."""

    def __init__(self) -> None:
        self._numeric: dict[str, array] = {n: array("d") for n in NUMERIC_COLUMNS}
        self._labels: dict[str, list[str]] = {n: [] for n in LABEL_COLUMNS}
        self._rows = 0

    def __len__(self) -> int:
        return self._rows

    def append(
        self,
        numeric: Mapping[str, float],
        labels: Mapping[str, str],
        custom: Mapping[str, float] | None = None,
    ) -> None:
        """One row: every column of NUMERIC_COLUMNS and LABEL_COLUMNS; any other numeric
        column (a producer's facts) and custom metrics are NaN in the rows without them."""
        for name in LABEL_COLUMNS:
            self._labels[name].append(labels.get(name) or "")
        optional = {name: value for name, value in numeric.items() if name not in NUMERIC_COLUMNS}
        optional.update({CUSTOM_PREFIX + name: value for name, value in (custom or {}).items()})
        for name in NUMERIC_COLUMNS:
            self._numeric[name].append(float(numeric[name]))
        for name, value in optional.items():
            column = self._numeric.get(name)
            if column is None:
                column = self._numeric[name] = array("d", [np.nan]) * self._rows
            column.append(float(value))
        self._rows += 1
        for column in self._numeric.values():
            if len(column) < self._rows:
                column.append(np.nan)

    @classmethod
    def from_cohort(cls, cohort: Cohort) -> CohortBuilder:
        """A builder holding `cohort`'s rows, to append to (a restored queue)."""
        builder = cls()
        for name, values in cohort.numeric.items():
            builder._numeric[name] = array("d", np.asarray(values, dtype=np.float64).tobytes())
        for name in LABEL_COLUMNS:
            builder._labels[name] = list(cohort.labels[name])
        builder._rows = len(cohort)
        return builder

    def build(self, limit: int | None = None) -> Cohort:
        """The first `limit` rows (all by default) as a Cohort; the builder is unchanged."""
        return Cohort(
            numeric={
                n: np.frombuffer(col, dtype=np.float64)[:limit].copy() for n, col in self._numeric.items()
            },
            labels={n: v[:limit] for n, v in self._labels.items()},
        )

    def column(self, name: str) -> np.ndarray:
        return np.frombuffer(self._numeric[name], dtype=np.float64).copy()

    @property
    def rollout_ids(self) -> list[str]:
        return list(self._labels["rollout_id"])

    def take(self, count: int) -> Cohort:
        """Remove the first `count` rows and return them: a queue of rows, cut in one slice."""
        cohort = self.build(count)
        for column in self._numeric.values():
            del column[:count]
        for labels in self._labels.values():
            del labels[:count]
        self._rows -= len(cohort)
        return cohort

    def remove(self, mask: np.ndarray) -> Cohort:
        """Remove the rows where `mask` is True and return them."""
        removed = self.build().take(mask)
        keep = ~mask
        for name, column in self._numeric.items():
            self._numeric[name] = array("d", np.frombuffer(column, dtype=np.float64)[keep].tobytes())
        for name, labels in self._labels.items():
            self._labels[name] = [value for value, kept in zip(labels, keep, strict=True) if kept]
        self._rows -= len(removed)
        return removed
