"""Vectorised MessagePack for one-dimensional numpy arrays, written into and read from a
byte buffer.

The writers (`writers`) produce exactly the bytes `msgpack.packb(array.tolist(),
use_bin_type=True)` would, straight from the array, in place in a preallocated uint8
buffer: no Python objects per element and only bounded temporaries (ints are processed in
chunks of `CHUNK` elements). The readers (`readers`) do the inverse for the homogeneous
cases (all floats, all bools, all ints, repeated strings) and return None for anything
else, so the caller can fall back to a general MessagePack reader for that value.

Variable-width ints are the hard part in both directions; see `writers.write_ints` and
`readers.read_ints`. What both halves share is here.
"""

from __future__ import annotations

import numpy as np

CHUNK = 1 << 15
"""Elements per vectorised step: temporaries stay around 2 MiB whatever the payload."""
SMALL = 64
"""Int arrays shorter than this go through msgpack: vectorising costs more than it saves."""


def overlapping_words(buffer: np.ndarray) -> np.ndarray:
    """Native uint64 words starting at every byte of `buffer` (stride 1): one unaligned
    8-byte load or store per element instead of one per byte."""
    return np.ndarray((max(len(buffer) - 7, 0),), np.uint64, buffer=buffer, strides=(1,))
