"""rlship's Redis clients (`transport.connection`: replies parsed by hiredis, commands packed
by redis-py's Python serializer): against the real Redis, every value, large or small, in
any reply shape, reads back as the bytes a stock client wrote, and what they write a stock
client reads back exactly, sync and asyncio."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from redis._parsers import _AsyncHiredisParser, _HiredisParser
from redis.connection import PythonRespSerializer

from transport.connection import PACK_BUFFER_CUTOFF, connect_redis, connect_redis_async

# Around the packer's cutoff, around the 64 KiB socket reads, and a payload's size.
SIZES = [
    PACK_BUFFER_CUTOFF - 1,
    PACK_BUFFER_CUTOFF + 1,
    16 * 1024,
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
    client = connect_redis(redis_url)
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
    client = connect_redis(redis_url)
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


def test_large_values_written_read_back_exactly_by_a_stock_client(
    redis_url: str, keys: tuple[redis.Redis, str]
) -> None:
    """SET, MSET and a pipeline's HSET, each a value of every size (the Python packer sends a
    large one as it is, after its length)."""
    stock, prefix = keys
    client = connect_redis(redis_url)
    values = {f"{prefix}{size}": blob(size, seed) for seed, size in enumerate(SIZES)}
    client.set(prefix + "one", values[f"{prefix}{3 << 20}"], ex=60)
    client.mset(values)
    pipe = client.pipeline(transaction=True)
    pipe.hset(prefix + "hash", mapping={name.encode(): value for name, value in values.items()})
    pipe.execute()
    assert stock.get(prefix + "one") == values[f"{prefix}{3 << 20}"]
    assert stock.mget(list(values)) == list(values.values())
    assert stock.hgetall(prefix + "hash") == {name.encode(): value for name, value in values.items()}


def test_the_asyncio_client_writes_and_reads_every_size_exactly(
    redis_url: str, keys: tuple[redis.Redis, str]
) -> None:
    stock, prefix = keys
    values = {f"{prefix}{size}": blob(size, seed) for seed, size in enumerate(SIZES)}

    async def round_trip() -> list[bytes | None]:
        client = connect_redis_async(redis_url)
        try:
            await client.mset(values)
            return await client.mget([*values, prefix + "missing"])
        finally:
            await client.aclose()

    assert asyncio.run(round_trip()) == [*values.values(), None]
    assert stock.mget(list(values)) == list(values.values())


def test_replies_are_parsed_by_hiredis_and_commands_packed_in_python(redis_url: str) -> None:
    """What the figures rest on (BENCHMARKS.md, "Replies parsed by hiredis"): hiredis's parser
    (an MGET of a rank's samples: 0.9 against 2.7 ms), redis-py's packer (hiredis's copies a
    3 MiB value: 6 against 0.6 ms), in the sync and the asyncio client."""
    connection = connect_redis(redis_url).connection_pool.get_connection()
    assert isinstance(connection._parser, _HiredisParser)
    assert isinstance(connection._command_packer, PythonRespSerializer)

    async def asyncio_connection() -> tuple[object, object]:
        client = connect_redis_async(redis_url)
        try:
            found = await client.connection_pool.get_connection()
            await found.connect()
            return found._parser, found._command_packer
        finally:
            await client.aclose()

    parser, packer = asyncio.run(asyncio_connection())
    assert isinstance(parser, _AsyncHiredisParser) and packer is None  # None: packed in Python
