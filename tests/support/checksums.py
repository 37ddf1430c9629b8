"""The tests' oracle for `transport.checksum.payload_checksum`: XXH3-128 by xxHash's
streaming state, fed in uneven pieces, another path through the library than the checksum's
one-shot call."""

from __future__ import annotations

import xxhash


def streamed_xxh3_128(data: bytes, piece: int = 1000) -> str:
    state = xxhash.xxh3_128()
    for start in range(0, len(data), piece):
        state.update(data[start : start + piece])
    return state.hexdigest()
