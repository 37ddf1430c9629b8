"""Fuzzed bytes from outside at the receiving end (issue 38): a rank's payload (random, cut
short, headers claiming gigabytes, bytes flipped, on both wires), a ZMQ topic frame, the
array blob a worker reads, and the settings file. Each is decoded or refused by its own
error naming what is wrong; never another exception, a hang or a huge allocation."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import msgpack
import pytest
from hypothesis import example

from orchestrator.settings_resolution import read_config_file
from tests.support.factories import make_batch, rollout
from tests.support.fuzz import fuzz, mangled, text
from transport.arrays_blob import PayloadCorruptError, pack_arrays, unpack_arrays
from transport.codec import CodecError, decode_microbatches, encode_microbatches
from transport.schema import WIRE_0F59B24, WIRE_559B447
from transport.zmq_sockets import parse_topic

PAYLOADS = [bytes(encode_microbatches([make_batch(list(range(n)))])) for n in (3, 70, 200)]


def _payload(rng: random.Random) -> tuple[bytes, object]:
    return mangled(rng, rng.choice(PAYLOADS)), rng.choice([WIRE_559B447, WIRE_0F59B24])


@fuzz(cases=_payload)
@example(
    cases=[(bytes([0x91, 0xDC, 0, 16, 0xDD, 0xFF, 0xFF, 0xFF, 0xFF]) + bytes(70), WIRE_559B447)]
)  # 32 GiB
def test_a_payload_decodes_or_is_refused_naming_the_micro_batch(cases):
    for data, wire in cases:
        try:
            decode_microbatches(data, wire)
        except CodecError as refused:
            assert str(refused).startswith(("payload: ", "micro-batch ")), refused


BLOBS = [pack_arrays(rollout(f"r{n}", "g", 1.0, num_output_tokens=n)[1]) for n in (1, 80)]


@fuzz(blobs=lambda rng: mangled(rng, rng.choice(BLOBS)))
@example(blobs=[msgpack.packb({"mm_kwargs.x": ["uint8", [2**32, 2**32], b""]})])  # int64 product wraps to 0
def test_an_array_blob_decodes_or_is_refused_naming_its_key(blobs):
    for blob in blobs:
        try:
            unpack_arrays(blob, "rollout:x")
        except PayloadCorruptError as refused:
            assert str(refused).startswith("rollout:x: stored arrays do not decode ("), refused


def _topic(rng: random.Random) -> bytes:
    digits = "1" * rng.choice([1, 18, 19, 5000])
    return mangled(
        rng, f"data_rank|{rng.choice(['0', digits])}|{rng.choice(['2', digits])}|{text(rng)}".encode()
    )


@fuzz(frames=_topic)
@example(frames=[b"data_rank|" + b"1" * 5000 + b"|1|run"])  # int(): over 4300 digits
def test_a_topic_frame_is_ours_or_none(frames):
    for frame in frames:
        topic = parse_topic(frame)
        assert topic is None or (topic.rank >= 0 and topic.step >= 0)


SETTINGS_TOML = [b'batch_size = 8\nseq_len = 512\nenvs = ["math"]\n', b"[x]\ny = 1\n"]


@pytest.fixture(scope="module")
def config_path():
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory) / "rlship.toml"


@fuzz(batch=25, files=lambda rng: mangled(rng, rng.choice(SETTINGS_TOML)))
@example(files=[b"\xff"])  # not UTF-8
def test_a_settings_file_is_read_or_refused_naming_the_file(files, config_path):
    for data in files:
        config_path.write_bytes(data)
        try:
            read_config_file(config_path)
        except SystemExit as refused:
            assert str(refused).startswith(f"rlship: config file {config_path}: "), refused
