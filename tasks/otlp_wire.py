"""OTLP's protobuf wire format for a pool process's task spans (`tasks.task_spans`), written
as bytes by hand rather than through the generated message classes.

Why: a task's two spans, built as protobuf objects (a `Span`, and a `KeyValue` and an
`AnyValue` for each of about ten attributes) cost more of the task's CPU than everything
else tracing does to it. A span is a handful of fields, and most attributes repeat from
one task to the next (the run, the stage, the worker, the state), so their bytes are
kept once made. The fields are those of opentelemetry-proto's `trace.proto` and
`common.proto`; `tests/unit/test_task_spans.py` holds the result to the SDK exporter's
encoding of the same spans.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

# A field's tag is a varint of (field number << 3) | wire type (0 varint, 1 fixed 64 bits,
# 2 length-delimited, 5 fixed 32 bits).
_ONE_BYTE = [bytes([value]) for value in range(128)]
_ATTRIBUTES_CACHED = 4096  # attribute bytes kept (run ids, stages, workers, states...); then cleared


def _varint(value: int) -> bytes:
    if 0 <= value < 128:
        return _ONE_BYTE[value]
    value &= (1 << 64) - 1  # a negative int64 as its two's complement, ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _length_delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


# AnyValue and KeyValue (opentelemetry.proto.common.v1)
_STRING, _BOOL, _INT, _DOUBLE, _ARRAY, _BYTES = (
    _tag(1, 2),
    _tag(2, 0),
    _tag(3, 0),
    _tag(4, 1),
    _tag(5, 2),
    _tag(7, 2),
)
_ARRAY_VALUE, _KEY, _VALUE = _tag(1, 2), _tag(1, 2), _tag(2, 2)
# Span and Status (opentelemetry.proto.trace.v1)
_TRACE_ID, _SPAN_ID, _PARENT_SPAN_ID = _tag(1, 2) + b"\x10", _tag(2, 2) + b"\x08", _tag(4, 2) + b"\x08"
_NAME, _KIND, _START, _END, _ATTRIBUTE, _STATUS = (
    _tag(5, 2),
    _tag(6, 0),
    _tag(7, 1),
    _tag(8, 1),
    _tag(9, 2),
    _tag(15, 2),
)
_FLAGS = _tag(16, 5)
# Link: its trace and span ids as a span's (fields 1 and 2), its flags as the exporter writes
# them for a link to a span of this process (`SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK`)
_LINK = _tag(13, 2)
_LINK_FLAGS = _tag(6, 5) + struct.pack("<I", 0x100)
_STATUS_MESSAGE, _STATUS_CODE_ERROR = _tag(2, 2), _tag(3, 0) + _varint(2)
_EMPTY_STATUS = _length_delimited(_STATUS, b"")
# ScopeSpans, ResourceSpans, ExportTraceServiceRequest
_SCOPE, _SPANS, _RESOURCE, _SCOPE_SPANS, _SCHEMA_URL = (
    _tag(1, 2),
    _tag(2, 2),
    _tag(1, 2),
    _tag(2, 2),
    _tag(3, 2),
)
_RESOURCE_SPANS = _tag(1, 2)
# Resource (opentelemetry.proto.resource.v1), InstrumentationScope
_RESOURCE_ATTRIBUTE, _SCOPE_NAME = _tag(1, 2), _tag(1, 2)


def _any_value(value: Any) -> bytes:
    """An `AnyValue`'s bytes (the oneof's field is written even when it holds its default)."""
    if isinstance(value, bool):
        return _BOOL + _ONE_BYTE[value]
    if isinstance(value, int):
        return _INT + _varint(value)
    if isinstance(value, float):
        return _DOUBLE + struct.pack("<d", value)
    if isinstance(value, str):
        return _length_delimited(_STRING, value.encode())
    if isinstance(value, bytes):
        return _length_delimited(_BYTES, value)
    if isinstance(value, list | tuple):
        items = b"".join(_length_delimited(_ARRAY_VALUE, _any_value(item)) for item in value)
        return _length_delimited(_ARRAY, items)
    return _length_delimited(_STRING, str(value).encode())


def _attribute(key: str, value: Any, tag: bytes = _ATTRIBUTE) -> bytes:
    """A `KeyValue`'s bytes as a field (a span's attributes unless `tag` says otherwise; an
    empty key, proto3's default, is not written)."""
    written_key = _length_delimited(_KEY, key.encode()) if key else b""
    return _length_delimited(tag, written_key + _length_delimited(_VALUE, _any_value(value)))


_attribute_bytes: dict[tuple[str, type, Any], bytes] = {}


def _kept_attribute(key: str, value: Any) -> bytes:
    """`_attribute`, its bytes kept when its value is a string or a bool: most repeat from
    task to task (a task's message id does not, hence the cap)."""
    if not isinstance(value, str | bool):
        return _attribute(key, value)
    cache_key = (key, type(value), value)
    found = _attribute_bytes.get(cache_key)
    if found is None:
        if len(_attribute_bytes) >= _ATTRIBUTES_CACHED:
            _attribute_bytes.clear()
        found = _attribute_bytes[cache_key] = _attribute(key, value)
    return found


def span(
    *,
    trace_id: int,
    span_id: int,
    parent_id: int,
    name: str,
    kind: int,
    start_ns: int,
    end_ns: int,
    attributes: dict[str, Any],
    links: Sequence[tuple[int, int]] = (),
    error: str | None,
    flags: int,
) -> bytes:
    """A `Span` message's bytes: its ids, name, kind, times, attributes, links (to spans of
    this process: (trace id, span id)), status (an error's message and code, else empty, as
    the exporter writes it) and flags."""
    parts = [_TRACE_ID, trace_id.to_bytes(16, "big"), _SPAN_ID, span_id.to_bytes(8, "big")]
    if parent_id:
        parts += (_PARENT_SPAN_ID, parent_id.to_bytes(8, "big"))
    if name:
        parts.append(_length_delimited(_NAME, name.encode()))
    if kind:
        parts += (_KIND, _varint(kind))
    parts += (_START, struct.pack("<Q", start_ns), _END, struct.pack("<Q", end_ns))
    parts += [_kept_attribute(key, value) for key, value in attributes.items()]
    for linked_trace, linked_span in links:
        link = (
            _TRACE_ID,
            linked_trace.to_bytes(16, "big"),
            _SPAN_ID,
            linked_span.to_bytes(8, "big"),
            _LINK_FLAGS,
        )
        parts.append(_length_delimited(_LINK, b"".join(link)))
    if error is None:
        parts.append(_EMPTY_STATUS)
    else:
        message = _length_delimited(_STATUS_MESSAGE, error.encode()) if error else b""
        parts.append(_length_delimited(_STATUS, message + _STATUS_CODE_ERROR))
    parts += (_FLAGS, struct.pack("<I", flags))
    return b"".join(parts)


def resource(attributes: Mapping[str, Any]) -> bytes:
    """A `Resource` message's bytes: its attributes."""
    return b"".join(_attribute(key, value, _RESOURCE_ATTRIBUTE) for key, value in attributes.items())


def scope(name: str) -> bytes:
    """An `InstrumentationScope` message's bytes: its name."""
    return _length_delimited(_SCOPE_NAME, name.encode())


def export_request(resource: bytes, scope: bytes, spans: list[bytes], schema_url: str) -> bytes:
    """An `ExportTraceServiceRequest`'s bytes: one `ResourceSpans` (an encoded `Resource`) of
    one `ScopeSpans` (an encoded `InstrumentationScope`) holding encoded `spans`."""
    scope_spans = _length_delimited(_SCOPE, scope) + b"".join(_length_delimited(_SPANS, one) for one in spans)
    resource_spans = _length_delimited(_RESOURCE, resource) + _length_delimited(_SCOPE_SPANS, scope_spans)
    if schema_url:
        resource_spans += _length_delimited(_SCHEMA_URL, schema_url.encode())
    return _length_delimited(_RESOURCE_SPANS, resource_spans)
