"""Fuzzed rollout arrays and segments (issue 38) through everything a producer does before
Redis: its checks (`check_rollouts`), the blob it packs and the facts it sends. Arrays of
any dtype, shape and length, NaN, inf and huge values, mm_kwargs of any shape; segments with
negative or huge offsets and rows, bad dtypes, files outside the root, short or gone. A call
is refused naming the field, or what it would write decodes and passes the workers' checks."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from orchestrator.producer import RolloutProducer, RolloutRejected
from orchestrator.records import RolloutRecord
from tasks.stages.credit import GivenCredit
from tasks.stages.finalize import PayloadFacts, check_rollout_arrays
from tests.support.fuzz import ARRAY_NAMES, fuzz, names_one_of, rollout_arrays, segment_values
from transport.arrays_blob import unpack_arrays
from transport.payload_segments import SideArrays

BASE = Path(tempfile.gettempdir()) / f"rlship-fuzz-{os.getpid()}"
ROOT, OUTSIDE = BASE / "root", BASE / "outside"
FILES = [
    str(ROOT / "run" / "ok.rows"),
    str(ROOT / "run" / "short.rows"),
    str(ROOT / "run" / "empty.rows"),
    str(ROOT / "run" / "gone.rows"),
    str(ROOT / "run"),
    str(ROOT / "run" / "link.rows"),
    str(ROOT / ".." / "outside" / "out.rows"),
    str(OUTSIDE / "out.rows"),
    "relative/ok.rows",
    str(ROOT / "run" / "a\x00b"),
]
MAX_TOKENS, VOCAB = 64, 1000
FIELDS = {*ARRAY_NAMES, "mm_kwargs", "payload"}


@pytest.fixture(scope="module", autouse=True)
def rows_files() -> Iterator[None]:
    """The files fuzzed segments point at: long enough, short, empty, a link out of the root."""
    (ROOT / "run").mkdir(parents=True)
    OUTSIDE.mkdir()
    (ROOT / "run" / "ok.rows").write_bytes(bytes(4096))
    (ROOT / "run" / "short.rows").write_bytes(bytes(10))
    (ROOT / "run" / "empty.rows").write_bytes(b"")
    (OUTSIDE / "out.rows").write_bytes(bytes(4096))
    (ROOT / "run" / "link.rows").symlink_to(OUTSIDE / "out.rows")
    yield
    shutil.rmtree(BASE)


def _segments(rng, tokens):
    return [segment_values(rng, FILES, tokens) for _ in range(rng.choice([0, 1, 1, 1, 2]))]


def _case(rng):
    return rollout_arrays(rng, _segments if rng.random() < 0.4 else None)


PRODUCER = RolloutProducer(
    redis.Redis(), "fuzz", max_tokens=MAX_TOKENS, vocab_size=VOCAB, side_arrays=SideArrays(root=str(ROOT))
)


def _record(tokens: int) -> RolloutRecord:
    return RolloutRecord(
        rollout_id="p1", group_id="g", task_id="t", env="math", policy_version=0, reward=1.0,
        num_input_tokens=tokens // 2, num_output_tokens=tokens - tokens // 2,
    )  # fmt: skip


@fuzz(batch=25, cases=_case)
def test_a_producer_call_is_refused_naming_the_field_or_writes_what_the_workers_take(cases):
    for tokens, arrays in cases:
        record = _record(tokens)
        try:
            # Everything `produce` does before its one Redis script: nothing of it is in Redis.
            _, data = PRODUCER._script_arguments([(record, arrays)], partial_groups=True)
        except RolloutRejected as refused:
            (problem,) = refused.problems.values()
            assert names_one_of(problem, FIELDS), problem
            continue
        _, blob, _, facts, _, credit = data
        stored = unpack_arrays(blob)
        assert check_rollout_arrays(stored, tokens, MAX_TOKENS, VOCAB, PRODUCER.side_arrays) is None
        assert PayloadFacts.from_wire(facts) is not None
        assert (GivenCredit.from_wire(credit) is not None) == ("advantages" in stored)
        _assert_trainable(stored, tokens)


def _assert_trainable(stored: dict, tokens: int) -> None:
    """What was written, held to the contract written out here (not the code's checks): one
    value a token in every token array, ids in the vocabulary, finite floats, a bool mask."""
    ids = stored["input_ids"]
    assert ids.shape == (tokens,) and ids.dtype.kind in "iu" and all(0 <= i < VOCAB for i in ids.tolist())
    assert stored["loss_mask"].dtype == bool
    for name in set(stored) & set(ARRAY_NAMES) - {"mm_kwargs.pixel_values"}:  # a tensor, any shape
        assert len(stored[name]) == tokens, name
        if name.endswith(("logprobs", "weights")) or name in ("advantages", "temperatures"):
            assert stored[name].ndim == 1 and all(math.isfinite(x) for x in stored[name].tolist()), name
        if name == "temperatures":
            assert all(x > 0 for x in stored[name].tolist())
