"""Redis clients that ride out a Redis restart.

Every long-lived process (orchestrator, workers, trainer ranks, producer) gets its clients
here, so they share one policy: a command that fails on a lost connection is retried with
backoff for about `OUTAGE_SECONDS`, long enough for a restart, short enough that a Redis
that stays down ends the process with a clear error instead of a hang.

Retrying is safe for rlship's writes: they are idempotent (SET, HSET, SADD, marks), guarded
(the record is written in a WATCH transaction, which redis-py does not replay: the
WatchError sends the publisher round its check again), or counters whose rare double count
after a lost reply costs only a statistic.
"""

from __future__ import annotations

import builtins
from typing import Any

import redis
import redis.asyncio as aioredis
from redis._parsers import _RESP3Parser
from redis._parsers.socket import SENTINEL, SERVER_CLOSED_CONNECTION_ERROR, SocketBuffer
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

OUTAGE_SECONDS = 30.0
_BACKOFF = {"cap": 1.0, "base": 0.05}
# 0.05, 0.1, ... capped at 1 s: about OUTAGE_SECONDS in all.
_RETRIES = 5 + int(OUTAGE_SECONDS)


# Bulk replies from this size on (payloads, most rollouts' arrays) are read straight from the
# socket into their own buffer; never a hash field or other map key, which must be hashable.
LARGE_REPLY_BYTES = 16 * 1024


class LargeReplyBuffer(SocketBuffer):
    """redis-py's socket buffer, but a large bulk reply (a step payload: megabytes) is read
    with `recv_into` straight into one bytearray of its size, which is returned as is.

    redis-py reads it in 64 KiB chunks, appends them to a BytesIO, reads them out, joins
    them and slices off the CRLF: four copies, and for an MGET of rollouts a BytesIO
    growing to the whole reply. Profiled in a ship worker, that was 57% of its task CPU
    (`rlship bench loop`, BENCHMARKS.md). Here the bytes already buffered are copied once and the rest goes
    from the kernel into the result. The value is a bytearray (bytes-like: hashing,
    decoding, ZMQ and file writes take it unchanged); smaller replies keep redis-py's path.
    """

    def read(self, length: int, timeout: float | object = SENTINEL) -> bytes | bytearray:
        if length < LARGE_REPLY_BYTES:
            return super().read(length, timeout)
        out = bytearray(length + 2)  # and the CRLF terminator
        with memoryview(out) as view:
            filled = self._buffer.readinto(view)
            if timeout is not SENTINEL:
                self._sock.settimeout(timeout)
            try:
                while filled < len(out):
                    received = self._sock.recv_into(view[filled:])
                    if not received:
                        raise ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
                    filled += received
            except builtins.TimeoutError:
                raise TimeoutError("Timeout reading from socket") from None
            finally:
                if timeout is not SENTINEL:
                    self._sock.settimeout(self.socket_timeout)
        del out[length:]
        return out


class LargeReplyParser(_RESP3Parser):
    """The RESP3 parser (redis-py's default protocol; it reads RESP2 replies too) on a
    `LargeReplyBuffer`."""

    def on_connect(self, connection: Any) -> None:
        super().on_connect(connection)
        self._buffer = LargeReplyBuffer(self._sock, self.socket_read_size, connection.socket_timeout)


def connect_redis(url: str, *, large_replies: bool = False, **options: Any) -> redis.Redis:
    """A client that rides out a restart; with `large_replies`, megabyte values are read
    without redis-py's copies (`LargeReplyBuffer`)."""
    if large_replies:
        options["parser_class"] = LargeReplyParser
    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(**_BACKOFF), _RETRIES),
        retry_on_error=[ConnectionError, TimeoutError],
        **options,
    )


def connect_redis_async(url: str, **options: Any) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        retry=AsyncRetry(ExponentialBackoff(**_BACKOFF), _RETRIES),
        retry_on_error=[ConnectionError, TimeoutError],
        **options,
    )
