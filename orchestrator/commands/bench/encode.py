"""`rlship bench encode`: the payload codec's speed and memory against msgpack, msgspec and
ormsgpack (the `bench` extra).

Three payload shapes of about 64 MiB (the seed PR's allocation check): one micro-batch,
sixteen of 4 MiB, and 63 MiB + 1 MiB. Every encoder gets realistic token data already in
the form it takes (numpy arrays for ours, prebuilt lists or structs for the others, arrays
plus `tolist()` for `msgpack_from_arrays`, the numpy arrays themselves for `ormsgpack` with
its OPT_SERIALIZE_NUMPY), is timed without tracemalloc (median of
`--trials`), and measured in separate runs under tracemalloc: the peak traced allocation
during the call, less what was allocated before it (numpy's allocations are traced).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np
import ormsgpack

from transport.codec import decode_microbatches, encode_microbatches, wire_size
from transport.schema import MICROBATCH_FIELDS, MicroBatch

MIB = 1 << 20
ENV_NAMES = ("math-python", "code-contests", "wordle")


class WireRoutedExperts(msgspec.Struct, array_like=True):
    """prime-rl's RoutedExperts: data, shape ([tokens, layers, topk]), dtype."""

    data: bytes
    shape: list[int]
    dtype: str


class WireEncodedTensor(msgspec.Struct, array_like=True):
    """prime-rl's EncodedTensor, an mm_kwargs value: dtype, shape, data."""

    dtype: str
    shape: list[int]
    data: bytes


class WireMicroBatch(msgspec.Struct, array_like=True):
    """The 16 wire fields as a msgspec struct: what a msgspec-based trainer decodes into."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: WireRoutedExperts | None = None
    mm_kwargs: dict[str, WireEncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


def make_microbatch(rng: np.random.Generator, num_tokens: int) -> MicroBatch:
    """Packed samples as an RL packer emits them: a few samples, prompt tokens unmasked,
    per-sample advantage, temperature and env name, position ids restarting per sample."""
    num_samples = int(rng.integers(3, 9))
    cuts = np.sort(rng.choice(np.arange(1, num_tokens), size=num_samples - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [num_tokens]])).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sample = np.repeat(np.arange(num_samples), lengths)
    position_ids = np.arange(num_tokens) - np.repeat(starts, lengths)
    prompt = (lengths * rng.uniform(0.1, 0.4, num_samples)).astype(np.int64)
    env_names: list[str] = []
    for env, length in zip(rng.integers(0, len(ENV_NAMES), num_samples), lengths.tolist(), strict=True):
        env_names.extend([ENV_NAMES[env]] * length)
    return MicroBatch(
        # Skewed ids: frequent tokens are small, the tail reaches the 150k vocabulary.
        input_ids=np.minimum(rng.lognormal(7.0, 2.2, num_tokens), 149_999).astype(np.int64),
        loss_mask=position_ids >= np.repeat(prompt, lengths),
        advantages=rng.normal(0.0, 1.0, num_samples)[sample],
        inference_logprobs=-rng.exponential(0.6, num_tokens),
        position_ids=position_ids,
        sequence_lengths=lengths,
        temperatures=rng.choice([0.7, 1.0], num_samples)[sample],
        env_names=env_names,
        seq_lens=lengths,
    )


def make_payload(rng: np.random.Generator, sizes_mib: list[float]) -> list[MicroBatch]:
    """Micro-batches whose wire sizes are about `sizes_mib`: each is built twice from the
    same seed, the second time with its token count corrected by the first's wire size."""
    probe = make_microbatch(np.random.default_rng(0), 50_000)
    bytes_per_token = wire_size([probe]) / probe.num_tokens
    batches = []
    for size in sizes_mib:
        seed = int(rng.integers(1 << 32))
        first = make_microbatch(np.random.default_rng(seed), int(size * MIB / bytes_per_token))
        tokens = int(size * MIB * first.num_tokens / wire_size([first]))
        batches.append(make_microbatch(np.random.default_rng(seed), tokens))
    return batches


CASES: dict[str, list[float]] = {
    "one_64MiB": [64.0],
    "sixteen_4MiB": [4.0] * 16,
    "63MiB_plus_1MiB": [63.0, 1.0],
}


def _seconds(calls: dict[str, Callable[[], Any]], trials: int) -> dict[str, float]:
    """Median seconds per call; the calls take turns within each trial, so that load from
    other processes on the machine falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(trials):
        for name, call in calls.items():
            gc.collect()
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _peak_bytes(call: Callable[[], Any], trials: int) -> int:
    """Largest traced allocation above the pre-call level, over `trials` calls."""
    peaks = []
    tracemalloc.start()
    try:
        for _ in range(trials):
            gc.collect()
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            result = call()
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
            del result
    finally:
        tracemalloc.stop()
    return max(peaks)


def progress(message: str) -> None:
    """A line on stderr as the bench goes (a whole run takes minutes); stdout keeps the tables."""
    print(f"bench encode: {message}", file=sys.stderr, flush=True)


def _measure(calls: dict[str, Callable[[], Any]], trials: int, label: str) -> dict[str, dict[str, float]]:
    progress(f"{label}: timing {', '.join(calls)} ({trials} trials)")
    seconds = _seconds(calls, trials)
    peaks = {}
    for name, call in calls.items():
        progress(f"{label}: peak memory of {name}")
        peaks[name] = _peak_bytes(call, trials)
    return {name: {"seconds": seconds[name], "peak_bytes": peaks[name]} for name in calls}


def numpy_wire_values(batch: MicroBatch, values: list[Any]) -> list[Any]:
    """`values` (the batch's `as_wire_values`) with every array field as the numpy array
    itself: what ormsgpack's OPT_SERIALIZE_NUMPY writes as a MessagePack array."""
    arrays = {name: getattr(batch, name) for name in MICROBATCH_FIELDS}
    return [
        arrays[name] if isinstance(arrays[name], np.ndarray) else value
        for name, value in zip(MICROBATCH_FIELDS, values, strict=True)
    ]


def run_case(name: str, batches: list[MicroBatch], trials: int) -> dict[str, Any]:
    lists = [b.as_wire_values() for b in batches]
    structs = [WireMicroBatch(*values) for values in lists]
    arrays = [numpy_wire_values(b, values) for b, values in zip(batches, lists, strict=True)]
    encoder = msgspec.msgpack.Encoder()
    encoders: dict[str, Callable[[], Any]] = {
        "ours": lambda: encode_microbatches(batches),
        "msgpack_lists": lambda: msgpack.packb(lists, use_bin_type=True),
        "msgpack_from_arrays": lambda: msgpack.packb(
            [b.as_wire_values() for b in batches], use_bin_type=True
        ),
        "msgspec": lambda: encoder.encode(structs),
        "ormsgpack": lambda: ormsgpack.packb(arrays, option=ormsgpack.OPT_SERIALIZE_NUMPY),
    }
    outputs = {key: bytes(call()) for key, call in encoders.items()}
    payload = outputs["msgpack_lists"]
    typed = msgspec.msgpack.Decoder(list[WireMicroBatch])
    decoders: dict[str, Callable[[], Any]] = {
        "ours": lambda: decode_microbatches(payload),
        "msgspec": lambda: typed.decode(payload),
        "msgpack": lambda: msgpack.unpackb(payload),
        "ormsgpack": lambda: ormsgpack.unpackb(payload),
    }
    decoded = decode_microbatches(payload)
    identical = len(set(outputs.values())) == 1 and all(
        a.equals(b) for a, b in zip(decoded, batches, strict=True)
    )
    del decoded, outputs
    return {
        "name": name,
        "wire_bytes": len(payload),
        "microbatches": len(batches),
        "tokens": sum(b.num_tokens for b in batches),
        "identical": identical,
        **_measure(encoders, trials, f"{name} encode"),
        "decode": _measure(decoders, trials, f"{name} decode"),
    }


def format_table(results: list[dict[str, Any]]) -> str:
    """Markdown: per case and encoder, seconds and peak / wire; then the ratios the goals name."""
    encoders = ("ours", "msgpack_lists", "msgpack_from_arrays", "msgspec", "ormsgpack")
    lines = [
        "| case | wire MiB | " + " | ".join(f"{key} s (peak/wire)" for key in encoders) + " |",
        "|---|---:|" + "---:|" * len(encoders),
    ]
    for case in results:
        cells = [
            f"{case[k]['seconds']:.3f} ({case[k]['peak_bytes'] / case['wire_bytes']:.2f})" for k in encoders
        ]
        lines.append(f"| {case['name']} | {case['wire_bytes'] / MIB:.1f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| case | decode: ours s (peak MiB) | msgspec s | msgpack s | ormsgpack s |",
        "|---|---:|---:|---:|---:|",
    ]
    for case in results:
        dec = case["decode"]
        lines.append(
            f"| {case['name']} | {dec['ours']['seconds']:.3f} ({dec['ours']['peak_bytes'] / MIB:.1f}) | "
            f"{dec['msgspec']['seconds']:.3f} | {dec['msgpack']['seconds']:.3f} | "
            f"{dec['ormsgpack']['seconds']:.3f} |"
        )
    lines += [
        "",
        "| case | identical | ours peak / wire | encode: msgpack_from_arrays / ours | msgspec / ours "
        "| ormsgpack / ours | decode: msgspec / ours | ormsgpack / ours |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in results:
        ours, dec = case["ours"], case["decode"]
        lines.append(
            f"| {case['name']} | {case['identical']} | {ours['peak_bytes'] / case['wire_bytes']:.3f} "
            f"| {case['msgpack_from_arrays']['seconds'] / ours['seconds']:.2f} "
            f"| {case['msgspec']['seconds'] / ours['seconds']:.2f} "
            f"| {case['ormsgpack']['seconds'] / ours['seconds']:.2f} "
            f"| {dec['msgspec']['seconds'] / dec['ours']['seconds']:.2f} "
            f"| {dec['ormsgpack']['seconds'] / dec['ours']['seconds']:.2f} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, required=True, help="write the results here")
    parser.add_argument("--trials", type=int, default=3, help="runs per measurement (median time, max peak)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the synthetic payloads")


def main(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    results = []
    for number, (name, sizes) in enumerate(CASES.items(), 1):
        progress(f"case {number}/{len(CASES)} {name}: building {sum(sizes):.0f} MiB of micro-batches")
        batches = make_payload(rng, sizes)
        results.append(run_case(name, batches, max(args.trials, 1)))
        del batches
    args.json.write_text(json.dumps({"trials": args.trials, "cases": results}, indent=2) + "\n")
    print(format_table(results))
    return 0 if all(case["identical"] for case in results) else 1
