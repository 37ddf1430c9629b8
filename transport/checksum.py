"""The payload checksum shared by senders and receivers, so tests and summaries can prove
that what a rank received is what the encoder produced. SHA-256: with the CPU's SHA
instructions it is the fastest strong hash hashlib offers here (3 MiB: 1.6 ms, against
2.3 ms for BLAKE2b), and every payload is hashed twice, by the encoder and by the rank."""

from __future__ import annotations

import hashlib


def payload_checksum(payload: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(payload).hexdigest()[:32]
