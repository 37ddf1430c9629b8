"""`packb_in_pieces` (the manifest and checkpoint packing the orchestrator does off its
loop) writes exactly the bytes of `msgpack.packb`, whatever the nesting and list lengths."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks import manifest
from tasks.manifest import packb_in_pieces

leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text() | st.binary()
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=40) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=200,
)


@settings(max_examples=300, deadline=None)
@given(value=values)
def test_same_bytes_as_packb_with_small_pieces(value: object) -> None:
    """With pieces of 3 items every list of 4 or more is split (the fixarray, array16 and
    piece-boundary cases all occur)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest, "PIECE_ITEMS", 3)
        assert packb_in_pieces(value) == msgpack.packb(value, use_bin_type=True)


@pytest.mark.parametrize("length", [0, 15, 16, 2047, 2048, 2049, 65535, 65536, 70001])
def test_same_bytes_as_packb_for_long_label_columns(length: int) -> None:
    """Label columns as a 16k-rollout manifest holds them, around the array header sizes."""
    value = {"labels": {"rollout_id": [f"r{i:07d}" for i in range(length)]}, "n": [0.5] * length}
    assert packb_in_pieces(value) == msgpack.packb(value, use_bin_type=True)
