"""The wire schema: what one trainer rank receives for one step.

A step's payload for a rank is a list of `MicroBatch`. Which fields travel, and in which
order, is the wire profile's (`WireProfile`): prime-rl's trainer MicroBatch at commit 559b447
(16 fields) or at 0f59b24 (20: `mm_refs` where `mm_kwargs` was, sampling masks, trace ids,
side arrays by handle); docs/wire-format.md. Fields are held as
numpy arrays so the packer and encoder never build Python lists of tokens; validation
runs at construction, so a malformed batch fails where it is built, naming the field.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Self

import numpy as np

from transport.payload_segments import PayloadSegment


class SchemaError(ValueError):
    """A micro-batch or sample whose fields do not agree with each other or the spec."""


# Tensor dtypes producers send that numpy has no name for (torch's), and their item sizes.
_EXTRA_ITEMSIZES = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _check_tensor_bytes(what: str, data: bytes, shape: tuple[int, ...], dtype: str) -> None:
    """Raw tensor bytes must be exactly shape x item size of dtype; errors name `what`."""
    if dtype in _EXTRA_ITEMSIZES:
        itemsize = _EXTRA_ITEMSIZES[dtype]
    else:
        try:
            itemsize = np.dtype(dtype).itemsize
        except (TypeError, ValueError, SyntaxError) as exc:  # a string numpy cannot read (it parses some)
            raise SchemaError(f"{what}.dtype: unknown dtype {dtype!r}") from exc
    if any(d < 0 for d in shape):
        raise SchemaError(f"{what}.shape: {shape} has a negative dimension")
    expected = itemsize * math.prod(shape)  # Python ints: a product past int64 must not wrap to a match
    if len(data) != expected:
        raise SchemaError(
            f"{what}.data: length {len(data)} does not match shape {shape} "
            f"of {dtype} (expected {expected} bytes)"
        )


class _RawTensor:
    """What the two raw tensors on the wire share (they differ in field order only): the
    fields frozen to bytes and a tuple of ints and checked against each other when one is
    built, and building one from a numpy array."""

    __slots__ = ()
    _field: ClassVar[str]
    """The MicroBatch field the tensor travels in, which errors name."""
    # Each subclass declares these as its dataclass fields, in its own wire order.
    data: bytes
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):
            raise SchemaError(f"{self._field}.dtype: expected str, got {self.dtype!r}")
        if not isinstance(self.data, bytes | bytearray | memoryview):  # bytes(3) would be 3 zero bytes
            raise SchemaError(f"{self._field}.data: expected bytes, got {type(self.data).__name__}")
        try:
            shape = tuple(operator.index(d) for d in self.shape)
        except TypeError:
            raise SchemaError(f"{self._field}.shape: {self.shape!r:.80} is not a list of ints") from None
        object.__setattr__(self, "data", bytes(self.data))
        object.__setattr__(self, "shape", shape)
        _check_tensor_bytes(self._field, self.data, self.shape, self.dtype)

    @classmethod
    def from_array(cls, array: np.ndarray) -> Self:
        array = np.ascontiguousarray(array)
        return cls(data=array.tobytes(), shape=array.shape, dtype=array.dtype.name)  # type: ignore[call-arg]


@dataclass(frozen=True, slots=True)
class RoutedExperts(_RawTensor):
    """Per-token expert routing (MoE), `[tokens, layers, topk]`, carried as raw bytes with
    their shape and dtype (prime-rl's wire order: data, shape, dtype)."""

    _field: ClassVar[str] = "routed_experts"
    data: bytes
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class EncodedTensor(_RawTensor):
    """One multimodal model input (an `mm_kwargs` value, e.g. `pixel_values`): raw bytes
    with their dtype and shape, as prime-rl encodes a tensor (wire order: dtype, shape,
    data). The dtype is the producer's name for it ("float32", "bfloat16", ...)."""

    _field: ClassVar[str] = "mm_kwargs"
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def concatenate(cls, name: str, tensors: Sequence[EncodedTensor]) -> EncodedTensor:
        """Stack along the first dimension (several samples' images in one micro-batch);
        dtypes and the other dimensions must agree."""
        first = tensors[0]
        for tensor in tensors[1:]:
            if tensor.dtype != first.dtype or tensor.shape[1:] != first.shape[1:] or not tensor.shape:
                raise SchemaError(
                    f"mm_kwargs[{name!r}]: cannot stack {tensor.dtype}{list(tensor.shape)} "
                    f"onto {first.dtype}{list(first.shape)} along the first dimension"
                )
        rows = sum(t.shape[0] for t in tensors) if first.shape else 0
        shape = (rows, *first.shape[1:]) if first.shape else ()
        return cls(dtype=first.dtype, shape=shape, data=b"".join(t.data for t in tensors))


MM_KWARGS_PREFIX = "mm_kwargs."
"""A rollout's stored arrays hold each mm_kwargs tensor under `mm_kwargs.{name}`."""


def as_encoded_tensors(value: Any) -> dict[str, EncodedTensor]:
    """mm_kwargs from what producers and decoders hold: name -> EncodedTensor, a numpy
    array, or the wire's [dtype, shape, data]."""
    if not isinstance(value, dict):
        raise SchemaError(f"mm_kwargs: expected a map of name to tensor, got {type(value).__name__}")
    out = {}
    for name, tensor in value.items():
        if not isinstance(name, str):
            raise SchemaError(f"mm_kwargs: key {name!r} is not a str")
        if isinstance(tensor, np.ndarray):
            tensor = EncodedTensor.from_array(tensor)
        elif isinstance(tensor, list | tuple) and len(tensor) == 3:
            tensor = EncodedTensor(*tensor)
        elif not isinstance(tensor, EncodedTensor):
            raise SchemaError(f"mm_kwargs[{name!r}]: expected [dtype, shape, data], got {tensor!r:.80}")
        out[name] = tensor
    return out


# The numpy dtype each per-token/per-sample array is held in (the fields not listed are
# not numeric arrays).
ARRAY_DTYPES: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int64),
    "loss_mask": np.dtype(np.bool_),
    "advantages": np.dtype(np.float64),
    "inference_logprobs": np.dtype(np.float64),
    "position_ids": np.dtype(np.int64),
    "sequence_lengths": np.dtype(np.int64),
    "temperatures": np.dtype(np.float64),
    "seq_lens": np.dtype(np.int64),
    "ref_logprobs": np.dtype(np.float64),
    "mm_token_type_ids": np.dtype(np.int64),
    "rl_weights": np.dtype(np.float64),
    "ce_weights": np.dtype(np.float64),
    "ref_kl_weights": np.dtype(np.float64),
}

PER_TOKEN_FIELDS: tuple[str, ...] = (
    "loss_mask",
    "advantages",
    "inference_logprobs",
    "position_ids",
    "temperatures",
    "env_names",
    "ref_logprobs",
    "mm_token_type_ids",
    "rl_weights",
    "ce_weights",
    "ref_kl_weights",
)


def check_routed_experts_shape(shape: tuple[int, ...], num_tokens: int) -> None:
    """Routed experts are per token: their first dimension is the token axis."""
    if not shape or shape[0] != num_tokens:
        raise SchemaError(
            f"routed_experts.shape: {shape}, expected first dimension {num_tokens} (len(input_ids))"
        )


def as_array(name: str, value: Any) -> np.ndarray:
    """Convert a sequence or array to the field's dtype, one-dimensional, without copying
    when it already is one."""
    dtype = ARRAY_DTYPES[name]
    try:
        if isinstance(value, np.ndarray) and value.dtype == dtype:
            array = value
        elif dtype.kind in "iu":
            array = np.asarray(value)
            if array.size and array.dtype.kind not in "iub":
                raise SchemaError(f"{name}: expected integers, got dtype {array.dtype}")
            if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
                raise SchemaError(f"{name}: value {int(array.max())} exceeds int64")
            array = array.astype(dtype, copy=False)
        elif dtype.kind == "b":
            array = np.asarray(value)
            if array.size and array.dtype.kind != "b":
                raise SchemaError(f"{name}: expected booleans, got dtype {array.dtype}")
            array = array.astype(dtype, copy=False)
        else:
            array = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, SchemaError):
            raise
        raise SchemaError(f"{name}: cannot be read as {dtype}: {exc}") from exc
    if array.ndim != 1:
        raise SchemaError(f"{name}: expected a one-dimensional sequence, got shape {array.shape}")
    return array


def _as_strings(name: str, value: Sequence[str]) -> list[str]:
    items = list(value)
    # Per-token env names repeat a few objects: check each distinct type once, at C speed.
    if all(issubclass(kind, str) for kind in set(map(type, items))):
        return items
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise SchemaError(f"{name}[{index}]: expected str, got {type(item).__name__} {item!r}")
    return items


@dataclass(slots=True, eq=False)
class MicroBatch:
    """One packed micro-batch: several samples concatenated along the token axis. Its fields
    are every profile's (the 16 of prime-rl 559b447 in their wire order, then those 0f59b24
    added); the optional ones default to None (`OPTIONAL_FIELDS`)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    position_ids: np.ndarray
    sequence_lengths: np.ndarray
    temperatures: np.ndarray
    env_names: list[str]
    seq_lens: np.ndarray
    ref_logprobs: np.ndarray | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    mm_token_type_ids: np.ndarray | None = None
    rl_weights: np.ndarray | None = None
    ce_weights: np.ndarray | None = None
    ref_kl_weights: np.ndarray | None = None
    mm_refs: list[Any] | None = None  # [[url, offset, length], ...] per image, as decoded
    sampling_mask: tuple[bytes, bytes] | None = None  # (int32 ids, int32 count per token)
    trace_ids: list[str] | None = None  # per sequence: the rollout it holds ("" for padding)
    branch_indices: list[int] | None = None  # per sequence (-1 for padding)
    payload: list[PayloadSegment] | None = None  # side arrays by handle, positions on input_ids

    def __post_init__(self) -> None:
        for name in ARRAY_DTYPES:
            value = getattr(self, name)
            if value is None:
                if name not in OPTIONAL_FIELDS:
                    raise SchemaError(f"{name}: required field is missing")
                continue
            setattr(self, name, as_array(name, value))
        self.env_names = _as_strings("env_names", self.env_names)
        if self.mm_kwargs is not None:
            self.mm_kwargs = as_encoded_tensors(self.mm_kwargs)
        if isinstance(self.routed_experts, dict):
            self.routed_experts = RoutedExperts(**self.routed_experts)
        if self.payload is not None:
            self.payload = as_segments(self.payload)
        if self.sampling_mask is not None:
            self.sampling_mask = _sampling_mask(self.sampling_mask)
        self.validate()

    def validate(self) -> None:
        """Check the spec's invariants; raise SchemaError naming the first field that breaks one."""
        num_tokens = len(self.input_ids)
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and len(value) != num_tokens:
                raise SchemaError(f"{name}: length {len(value)}, expected {num_tokens} (len(input_ids))")
        if len(self.sequence_lengths) != len(self.seq_lens):
            raise SchemaError(
                f"seq_lens: length {len(self.seq_lens)}, expected {len(self.sequence_lengths)} "
                "(len(sequence_lengths))"
            )
        for name in ("sequence_lengths", "seq_lens"):
            total = int(getattr(self, name).sum())
            if total != num_tokens:
                raise SchemaError(f"{name}: sums to {total}, expected {num_tokens} (len(input_ids))")
        if self.routed_experts is not None:
            check_routed_experts_shape(self.routed_experts.shape, num_tokens)
        for name in ("trace_ids", "branch_indices"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.sequence_lengths):
                expected = f"{len(self.sequence_lengths)} (len(sequence_lengths))"
                raise SchemaError(f"{name}: length {len(value)}, expected {expected}")
        for index, segment in enumerate(self.payload or ()):
            if segment.end > num_tokens:
                raise SchemaError(
                    f"payload[{index}]: rows [{segment.pos}, {segment.end}) of {segment.field} run past "
                    f"the micro-batch's {num_tokens} tokens"
                )

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def as_wire_values(self, wire: WireProfile | None = None) -> list[Any]:
        """The profile's positional values as plain Python objects: what `msgpack.packb` would
        be given by a straightforward encoder (the reference for byte-identity)."""
        wire = wire or WIRE_559B447
        values: list[Any] = []
        for name in wire.fields:
            value = getattr(self, name)
            if value is None:
                values.append(None)
            elif isinstance(value, np.ndarray):
                values.append(value.tolist())
            elif isinstance(value, RoutedExperts):
                values.append([value.data, list(value.shape), value.dtype])
            elif name == "mm_kwargs":
                values.append({k: [t.dtype, list(t.shape), t.data] for k, t in value.items()})
            elif name == "payload":
                values.append([segment.to_wire() for segment in value])
            else:
                values.append(list(value))
        return values

    def equals(self, other: MicroBatch) -> bool:
        """Field-by-field equality (NaN equal to NaN), for tests and the reference trainer."""
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if (mine is None) != (theirs is None):
                return False
            if isinstance(mine, np.ndarray):
                if mine.shape != theirs.shape or not np.array_equal(
                    mine, theirs, equal_nan=mine.dtype.kind == "f"
                ):
                    return False
            elif mine != theirs:
                return False
        return True


def as_segments(value: Any) -> list[PayloadSegment]:
    """Side arrays by handle from what producers and decoders hold: segments, or their wire
    (or stored) values; SchemaError names the segment that is neither. A segment a producer
    built itself is checked as its values are (a negative offset is no less wrong)."""
    if not isinstance(value, list | tuple):
        raise SchemaError(f"payload: expected a list of segments, got {type(value).__name__}")
    try:
        return [
            PayloadSegment.from_values(s.to_stored() if isinstance(s, PayloadSegment) else s, f"payload[{i}]")
            for i, s in enumerate(value)
        ]
    except ValueError as exc:
        raise SchemaError(str(exc)) from None


def _sampling_mask(value: Any) -> tuple[bytes, bytes]:
    """prime-rl's SamplingMask: int32 token ids and an int32 count per token position."""
    if not isinstance(value, list | tuple) or len(value) != 2 or not all(isinstance(v, bytes) for v in value):
        raise SchemaError(f"sampling_mask: expected [ids: bin, counts: bin], got {value!r:.80}")
    ids, counts = value
    if len(ids) % 4 or len(counts) % 4:
        raise SchemaError(f"sampling_mask: {len(ids)} id bytes, {len(counts)} count bytes: not int32s")
    expected = 4 * int(np.frombuffer(counts, "<i4").sum())
    if len(ids) != expected:
        raise SchemaError(f"sampling_mask.ids: {len(ids)} bytes, the counts say {expected}")
    return (ids, counts)


MICROBATCH_FIELDS: tuple[str, ...] = tuple(field.name for field in fields(MicroBatch))[:16]
"""The wire order of prime-rl 559b447's 16 MicroBatch fields."""
OPTIONAL_FIELDS: frozenset[str] = frozenset(
    field.name for field in fields(MicroBatch) if field.default is None
)
"""The fields a micro-batch may leave out (None)."""


@dataclass(frozen=True)
class WireProfile:
    """One trainer's MicroBatch layout: its fields in wire order. Every field is written, an
    unset one as nil: prime-rl's structs are msgspec `array_like`, which writes every field
    even with `omit_defaults` (msgspec issue #720), so this is what its own sender writes."""

    name: str
    fields: tuple[str, ...]

    def carries(self, name: str) -> bool:
        return name in self.fields

    def refuse_uncarried(self, batch: MicroBatch) -> None:
        """A micro-batch holding a field this profile has no place for is not written at all."""
        for field in fields(batch):
            if getattr(batch, field.name) is not None and not self.carries(field.name):
                raise SchemaError(f"{field.name}: wire {self.name} cannot carry it")


WIRE_559B447 = WireProfile("prime-rl-559b447", MICROBATCH_FIELDS)
WIRE_0F59B24 = WireProfile(
    "prime-rl-0f59b24",
    (
        *MICROBATCH_FIELDS[:11],
        "mm_refs",
        *MICROBATCH_FIELDS[12:],
        "sampling_mask",
        "trace_ids",
        "branch_indices",
        "payload",
    ),
)
WIRE_PROFILES: dict[str, WireProfile] = {profile.name: profile for profile in (WIRE_559B447, WIRE_0F59B24)}
"""The profiles by the name `--wire` takes."""


def default_wire(workload: str) -> WireProfile:
    """The wire a run uses unless told: side arrays by handle (the moe workload) need 0f59b24;
    otherwise 559b447, which prime-rl's trainers in use decode."""
    return WIRE_0F59B24 if workload == "moe" else WIRE_559B447
