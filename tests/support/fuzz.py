"""Fuzzed outside bytes and values for the entry points that take them (issue 38): the
generators, how many inputs a fuzz test runs, and the shape of a clean refusal.

A fuzz test draws `FUZZ_INPUTS` inputs per entry point: 10,000 under CI (`CI=true`, where the
`ci` Hypothesis profile of tests/conftest.py also derandomizes them, so CI fuzzes the same
inputs every run), 1,000 on a developer's machine (`RLSHIP_FUZZ_INPUTS` sets it).

Hypothesis's own strategies cost it about a millisecond a draw, and an input takes dozens,
which would make 10,000 inputs a minute per entry point. So Hypothesis draws one seed per
input, and a generator here builds the input from it with `random.Random` (nasty values
sampled often, random ones beside them); each example is a batch of such inputs (`fuzz`).
Hypothesis still drives, reproduces and reports: a failing example is shown as the inputs
themselves (the seeds are mapped), and a test keeps it as an explicit `@example`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.factories import rollout

CI = os.environ.get("CI") == "true"
FUZZ_INPUTS = 10_000 if CI else int(os.environ.get("RLSHIP_FUZZ_INPUTS", "1000"))
"""Inputs per fuzzed entry point."""

Generator = Callable[[random.Random], Any]


def fuzzed(generator: Generator) -> st.SearchStrategy[Any]:
    """Inputs of `generator`, each from a seed Hypothesis draws (shown as the input)."""
    return st.integers(0, 2**32 - 1).map(lambda seed: generator(random.Random(seed)))


def fuzz(batch: int = 50, inputs: int = FUZZ_INPUTS, **generators: Generator) -> Callable[[Any], Any]:
    """`@given` a list of `batch` inputs of each generator an example, for enough examples to
    make `inputs` inputs (fewer for an entry point too slow for `FUZZ_INPUTS`, such as one
    through Redis); no deadline (a slow example is not a failure here: the suite's timeout
    catches a hang)."""
    lists = {name: st.lists(fuzzed(gen), min_size=batch, max_size=batch) for name, gen in generators.items()}
    return lambda test: settings(max_examples=-(-inputs // batch), deadline=None)(given(**lists)(test))


def names_one_of(problem: str, names: set[str]) -> bool:
    """Whether a refusal starts by naming one of `names` (plain, or quoted as the code quotes
    an odd one), then its sub-field or what is wrong."""
    return any(problem.startswith((f"{name}:", f"{name}.", f"{name}[", f"{name!r}:")) for name in names)


# --- JSON-ish values and records ------------------------------------------------------------

HUGE_INTS = [2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, -(2**70), 10**400]
# Values that have broken parsers; random ones are drawn beside them.
NASTY_SCALARS = [
    None,
    True,
    False,
    0,
    -1,
    1,
    7,
    *HUGE_INTS,
    0.0,
    -0.0,
    0.5,
    1e308,
    -1e-320,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    " ",
    "a",
    "a b",
    "math",
    "x" * 201,
    "é",
    "\x00",
    "\udcff",
    "1",
    "-1",
    "NaN",
    "Infinity",
    "true",
    "null",
    "/abs/path",
    "a:b",
    "1e3",
    "١٢",
]
NASTY_KEYS = ["", "a", "a b", "rollout_id", "[key]", "k.j", "x:y", "\x00", "é", "metrics"]
DEEP_VALUES = [[[[]]], {"a": {"b": [1, {"c": None}]}}, [None] * 50, {"": []}]
TEXT = "ab/._- :é\x00\n\t☃𝄞1"


def text(rng: random.Random, most: int = 12) -> str:
    return "".join(rng.choice(TEXT) for _ in range(rng.randint(0, most)))


def json_scalar(rng: random.Random) -> Any:
    kind = rng.randrange(6)
    if kind <= 2:
        return rng.choice(NASTY_SCALARS)
    if kind == 3:
        return rng.randint(-(2**70), 2**70) >> rng.randrange(72)
    if kind == 4:
        return struct.unpack("<d", rng.randbytes(8))[0]  # any double: NaN, inf, subnormals
    return text(rng)


def json_value(rng: random.Random) -> Any:
    kind = rng.randrange(8)
    if kind == 0:
        return [json_scalar(rng) for _ in range(rng.randint(0, 3))]
    if kind == 1:
        return {rng.choice(NASTY_KEYS): json_scalar(rng) for _ in range(rng.randint(0, 3))}
    if kind == 2:
        return rng.choice(DEEP_VALUES)
    return json_scalar(rng)


def good_record_fields() -> dict[str, Any]:
    return rollout("good", "g", 1.0)[0].model_dump()


RECORD_FIELDS = sorted(good_record_fields())


def record_fields(rng: random.Random) -> dict[str, Any]:
    """A good record's fields with some removed, replaced by any JSON-ish value, or added."""
    fields = good_record_fields()
    for name in rng.sample(RECORD_FIELDS, rng.randint(0, 4)):
        if rng.random() < 0.3:
            del fields[name]
        else:
            fields[name] = json_value(rng)
    if rng.random() < 0.15:
        fields[rng.choice(NASTY_KEYS) if rng.random() < 0.5 else text(rng)] = json_value(rng)
    return fields


def record_bytes(rng: random.Random) -> bytes:
    """A stream entry's `record` as anyone could have written it: fuzzed fields as JSON, that
    JSON cut short or with bytes flipped, JSON of another shape, deep nesting, or any bytes."""
    kind = rng.randrange(10)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 80))
    if kind == 1:
        return json.dumps(json_value(rng)).encode()
    if kind == 2:
        depth = rng.choice([100, 1_000, 100_000])
        return b"[" * depth + b"]" * depth
    raw = bytearray(json.dumps(record_fields(rng)).encode())
    if kind == 3:
        return bytes(raw[: rng.randint(0, len(raw))])
    if kind == 4:
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    return bytes(raw)


def word(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return str(rng.choice([*HUGE_INTS, 0, -1, 1, 10**6]))
    if kind == 1:
        return str(rng.randint(-(10**7), 10**7))
    if kind == 2:
        return rng.choice(["", "x", "routed_experts", "1e3", "0x10", "١٢", "nan", "-0", "1_0", "\udcff"])
    return text(rng)


def facts_bytes(rng: random.Random) -> bytes | None:
    """A stream entry's `facts`: none, words (numbers or not, 0 to 8 of them) joined by
    spaces, five numbers and a field then a path with spaces or NUL, or any bytes."""
    kind = rng.randrange(6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.randbytes(rng.randint(0, 60))
    words = [word(rng) for _ in range(rng.randint(0, 8))]
    if kind == 2:
        words = [str(rng.randint(0, 10**6)) for _ in range(5)] + ["f"]
        words.append(rng.choice(["/tmp/a b", "/tmp/\x00x", "rel/path", "/", " "]))
    return " ".join(words).encode("utf-8", "surrogatepass")


# --- rollout arrays and segments -----------------------------------------------------------

DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "<U3",
    "S2",
    "datetime64[s]",
    "object",
    "V4",
    ">i4",
    ">f8",
]
ARRAY_NAMES = [
    "input_ids",
    "loss_mask",
    "inference_logprobs",
    "ref_logprobs",
    "routed_experts",
    "ce_weights",
    "ref_kl_weights",
    "mm_token_type_ids",
    "advantages",
    "rl_weights",
    "temperatures",
    "mm_kwargs.pixel_values",
    "ref_logprob",
    "",
]
EXTREMES = [0, 1, -1, 2**7, 2**15, 2**31 - 1, 2**40, 2**63 - 1, -(2**63)]


def numpy_array(rng: random.Random, tokens: int) -> np.ndarray:
    """An array of any dtype, 0 to 3 dimensions, mostly `tokens` long, its bytes random (NaN,
    inf and extremes among them) or its values extremes."""
    dtype = np.dtype(rng.choice(DTYPES))
    length = rng.choice([tokens, tokens, tokens, 0, tokens + 1, max(tokens - 1, 0), 600])
    shape = rng.choice([(length,), (length,), (length,), (), (length, 2), (length, 3, 2), (0, length)])
    count = int(np.prod(shape))
    if dtype.kind == "O":
        return np.array([json_scalar(rng) for _ in range(count)] + [None], dtype=object)[:count].reshape(
            shape
        )
    if dtype.kind in "iu" and rng.random() < 0.5:
        values = [rng.choice(EXTREMES) for _ in range(count)]
        return np.array(values, dtype=object).reshape(shape)  # NumPy picks no dtype: the producer's problem
    return np.frombuffer(rng.randbytes(count * dtype.itemsize), dtype).reshape(shape).copy()


def non_array(rng: random.Random) -> Any:
    return rng.choice([json_value(rng), rng.randbytes(rng.randint(0, 8)), np.float64("nan"), [1, [2]]])


def rollout_arrays(
    rng: random.Random, segments: Callable[[random.Random, int], Any] | None = None
) -> tuple[int, dict[str, Any]]:
    """A good rollout's arrays with none to three things wrong: an array replaced by a fuzzed
    one or by something not an array, removed, added under any name, one value set to NaN,
    inf, a negative or huge token id, or mm_kwargs of any shape; with `segments`, side arrays
    by handle besides. Returns the tokens the record says, and the arrays."""
    tokens = rng.randint(0, 12)
    _, arrays = rollout("p1", "g", 1.0, num_input_tokens=tokens // 2, num_output_tokens=tokens - tokens // 2)
    arrays: dict[str, Any] = {name: value.copy() for name, value in arrays.items()}
    for _ in range(rng.randint(0, 3)):
        kind = rng.randrange(6)
        name = rng.choice(ARRAY_NAMES)
        if kind == 0:
            arrays[name] = numpy_array(rng, tokens)
        elif kind == 1:
            arrays[name] = non_array(rng)
        elif kind == 2:
            arrays.pop(name, None)
        elif kind == 3 and tokens:
            target = rng.choice(["input_ids", "inference_logprobs"])
            floats = target == "inference_logprobs"
            current = arrays.get(target)
            if isinstance(current, np.ndarray) and current.shape == (tokens,) and current.dtype.kind in "iuf":
                values = current.astype(np.float64 if floats else np.int64)
                values[rng.randrange(tokens)] = rng.choice(
                    [np.nan, np.inf, -np.inf] if floats else [-1, 2**40, 2**63 - 1]
                )
                arrays[target] = values
        elif kind == 4:
            tensor = rng.choice(
                [
                    non_array(rng),
                    numpy_array(rng, tokens),
                    [json_scalar(rng), json_value(rng), rng.randbytes(9)],
                    ["uint8", [rng.choice([*EXTREMES, *HUGE_INTS]), 2], b""],
                ]
            )
            arrays["mm_kwargs"] = rng.choice([{text(rng, 5): tensor}, non_array(rng)])
    if segments is not None:
        arrays["payload"] = segments(rng, tokens)
    return tokens, arrays


SEGMENT_DTYPES = [
    "uint8",
    "int32",
    "float32",
    "bool",
    "object",
    "V0",
    "<U2",
    "(2)i4",
    "i4,i4",
    "",
    "bfloat16",
    "complex1024",
    "(99999999999)u1",
    "i99999999999999999999",
    "M8[xx]",
    "\x00",
]


def segment_int(rng: random.Random) -> Any:
    return rng.choice([rng.randint(-3, 40), rng.randint(0, 12), rng.choice(HUGE_INTS), json_scalar(rng)])


def segment_values(rng: random.Random, files: list[str], tokens: int) -> list[Any]:
    """One segment as a producer or a blob may hold it: a good one (rows of `files[0]` for
    the rollout's `tokens`) with none to three of its values replaced by another of the wrong
    type or out of range, or its file by another of `files` (short, outside the root, gone,
    relative, a directory, a NUL in its name, ...); its stored digest and inline flag, any."""
    values: list[Any] = ["routed_experts", files[0], 0, 0, tokens, "uint8", [2]]
    choices = [
        lambda: rng.choice(["routed_experts", "sampling_mask", "a b", "", "x\udcff", json_scalar(rng)]),
        lambda: rng.choice([*files, json_scalar(rng)]),
        lambda: segment_int(rng),
        lambda: segment_int(rng),
        lambda: segment_int(rng),
        lambda: rng.choice([*SEGMENT_DTYPES, json_scalar(rng)]),
        lambda: rng.choice([[segment_int(rng) for _ in range(rng.randint(0, 3))], [1, 2], json_scalar(rng)]),
    ]
    for at in rng.sample(range(7), rng.choice([0, 1, 1, 1, 2, 3])):
        values[at] = choices[at]()
    if rng.random() < 0.5:
        values += [json_scalar(rng), json_scalar(rng)]
    if rng.random() < 0.05:
        values = values[: rng.randint(0, 8)]
    return values


# --- blobs and payloads --------------------------------------------------------------------


def mangled(rng: random.Random, data: bytes) -> bytes:
    """`data` cut short, with bytes flipped or inserted or a length header blown up, grown by
    trailing bytes, or any bytes in its place."""
    raw = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0 or not raw:
        return rng.randbytes(rng.randint(0, 200))
    if kind == 1:
        return bytes(raw[: rng.randrange(len(raw))])
    if kind == 2:
        return bytes(raw + rng.randbytes(rng.randint(1, 20)))
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(raw))
        if kind == 3:
            raw[at] = rng.randrange(256)
        elif kind == 4:
            # A header claiming far more than there is: array32, bin32, str32, map32.
            tag = rng.choice([0xDD, 0xC6, 0xDB, 0xDF, 0xDC])
            raw[at : at + 5] = bytes([tag]) + rng.choice(
                [b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x01\x00\x00"]
            )
        else:
            raw[at:at] = rng.randbytes(rng.randint(1, 6))
    return bytes(raw)


# --- logs ----------------------------------------------------------------------------------


@contextmanager
def logged(name: str) -> Iterator[list[str]]:
    """The messages a logger emits (WARNING and up) meanwhile, without pytest's `caplog`
    (function-scoped: Hypothesis would share one across examples)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger(name)
    handler = Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
