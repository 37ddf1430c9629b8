"""The workers' Redis client reads large values (payloads, rollouts' arrays) straight from
the socket (`transport.connection.LargeReplyBuffer`): against the real Redis, every value,
large or small, in any reply shape, reads back as the bytes a stock client wrote."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from transport.connection import LARGE_REPLY_BYTES, connect_redis

# Around the threshold, around redis-py's 64 KiB socket reads, and a payload's size.
SIZES = [
    LARGE_REPLY_BYTES - 1,
    LARGE_REPLY_BYTES,
    LARGE_REPLY_BYTES + 1,
    65536 - 2,
    65536,
    65536 + 7,
    3 << 20,
]


def blob(size: int, seed: int) -> bytes:
    """Random bytes with CRLFs inside: the reader must count bytes, never look for a terminator."""
    data = bytearray(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    data[size // 2 : size // 2 + 2] = b"\r\n"
    return bytes(data)


@pytest.fixture
def keys(redis_url: str) -> Iterator[tuple[redis.Redis, str]]:
    """A stock client (the oracle's writer) and a key prefix, deleted afterwards."""
    stock = redis.Redis.from_url(redis_url)
    prefix = f"test-large-replies:{uuid.uuid4().hex[:8]}:"
    yield stock, prefix
    found = list(stock.scan_iter(match=prefix + "*"))
    if found:
        stock.delete(*found)


def test_get_reads_every_size_exactly(redis_url: str, keys: tuple[redis.Redis, str]) -> None:
    stock, prefix = keys
    client = connect_redis(redis_url, large_replies=True)
    for seed, size in enumerate(SIZES):
        stock.set(prefix + str(size), blob(size, seed), ex=60)
    for seed, size in enumerate(SIZES):
        value = client.get(prefix + str(size))
        assert len(value) == size
        assert bytes(value) == blob(size, seed), size
        assert client.ping()  # the connection is left at the next reply


def test_mget_pipeline_and_hash_keep_order_and_neighbours(
    redis_url: str, keys: tuple[redis.Redis, str]
) -> None:
    """Large values between small ones and missing keys, in one reply and in a pipeline
    (whose later replies are already buffered when a large one is read)."""
    stock, prefix = keys
    client = connect_redis(redis_url, large_replies=True)
    values = {f"{prefix}{i}": blob(size, i) for i, size in enumerate([10, 3 << 20, 200_000, 3, 70_000])}
    stock.mset(values)
    stock.hset(prefix + "hash", mapping={"small": b"x", "large": values[f"{prefix}1"]})
    names = [*values, prefix + "missing"]
    expected = [*values.values(), None]
    assert [None if v is None else bytes(v) for v in client.mget(names)] == expected
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    pipe.hgetall(prefix + "hash")
    *got, mapping = pipe.execute()
    assert [None if v is None else bytes(v) for v in got] == expected
    assert {k: bytes(v) for k, v in mapping.items()} == {b"small": b"x", b"large": values[f"{prefix}1"]}
