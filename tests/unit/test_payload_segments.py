"""Segments of side arrays by handle, on real files: clipping and shifting keep every row
where it was (the oracle: numpy slices of the array written), a window read with `pread` is
those rows, and each check of a rollout's segments names the field and the value."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from transport.payload_segments import (
    ANYWHERE,
    PayloadSegment,
    SegmentReader,
    SideArrays,
    clip_segments,
    read_windows,
    segments_problem,
    shift_segments,
    write_segment_file,
)


@pytest.fixture
def experts(tmp_path):
    rows = np.random.default_rng(0).integers(0, 128, (20, 4, 2), dtype=np.uint8)
    (segment,) = write_segment_file(tmp_path / "r.rows", {"routed_experts": rows})
    return rows, segment


def read(segments: list[PayloadSegment], tokens: int) -> np.ndarray:
    with SegmentReader() as reader:
        return read_windows(segments, tokens, reader)["routed_experts"]


def test_a_clipped_segment_points_at_its_own_rows(experts) -> None:
    rows, segment = experts
    (clipped,) = clip_segments([segment], 5, 9)
    assert (clipped.pos, clipped.rows, clipped.offset) == (5, 4, 5 * 8) and clipped.digest == ""
    assert np.array_equal(read([shift_segments([clipped], -5)[0]], 4), rows[5:9])
    assert clip_segments([segment], 20, 30) == [] and clip_segments([segment], 0, 20) == [segment]


def test_two_segments_in_one_window_and_a_gap_read_as_zero(experts, tmp_path) -> None:
    rows, segment = experts
    head, tail = clip_segments([segment], 0, 8), clip_segments([segment], 12, 20)
    window = read([*shift_segments(tail, 2), *head], 22)
    expected = np.zeros((22, 4, 2), np.uint8)
    expected[:8], expected[14:22] = rows[:8], rows[12:20]
    assert np.array_equal(window, expected)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            {"rows": 19},
            "payload.routed_experts: token 19 is covered by no segment (each token needs exactly one row)",
        ),
        ({"pos": 1}, r"payload.routed_experts: rows [1, 21) run past the rollout's 20 tokens"),
        ({"file": "relative.rows"}, r"payload.routed_experts: file 'relative.rows' is not an absolute path"),
        (
            {"offset": 8},
            "payload.routed_experts: file {file} holds 160 bytes, its rows need 168",
        ),
        (
            {"file": "/nonexistent/r.rows"},
            "payload.routed_experts: file /nonexistent/r.rows cannot be read (No such file or directory)",
        ),
    ],
)
def test_a_bad_segment_is_named(experts, change, problem) -> None:
    _, segment = experts
    assert segments_problem([replace(segment, **change)], 20, ANYWHERE) == problem.format(file=segment.file)


def test_overlapping_or_disagreeing_segments_and_files_outside_the_root_are_named(experts, tmp_path) -> None:
    _, segment = experts
    twice = segments_problem([segment, segment], 20, ANYWHERE)
    assert (
        twice == "payload.routed_experts: token 0 is covered by 2 segments (each token needs exactly one row)"
    )
    head, tail = (
        clip_segments([segment], 0, 10),
        clip_segments([replace(segment, dtype="int16", shape=(4,))], 10, 20),
    )
    assert segments_problem([*head, *tail], 20, ANYWHERE) == (
        "payload.routed_experts: segments disagree on rows (int16[4] after uint8[4, 2])"
    )
    elsewhere = tmp_path / "root"
    assert segments_problem([segment], 20, SideArrays(str(elsewhere))) == (
        f"payload.routed_experts: file {segment.file} is outside the payload root {elsewhere}"
    )
    assert segments_problem([segment], 20, SideArrays(str(tmp_path))) is None
