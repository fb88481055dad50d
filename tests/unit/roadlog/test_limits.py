"""The byte limits of every hop, and packing items into runs bounded by
count and bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from roadlog import limits
from roadlog.limits import chunk_by_bytes

pytestmark = pytest.mark.unit


def test_each_hop_takes_more_than_the_one_before_it_sends() -> None:
    assert limits.HTTP_BODY_BYTES <= limits.CLIENT_MESSAGE_BYTES
    assert limits.CLIENT_MESSAGE_BYTES + limits.WORK_ENVELOPE_BYTES <= limits.WORK_MESSAGE_BYTES
    assert limits.WORK_MESSAGE_BYTES < limits.PEER_MESSAGE_BYTES
    assert limits.ENTRY_BYTES < limits.PEER_MESSAGE_BYTES


def test_runs_close_at_the_byte_bound_and_a_big_item_goes_alone() -> None:
    assert chunk_by_bytes([3, 3, 3, 10, 1, 1], max_count=100, max_bytes=6) == [
        range(0, 2),
        range(2, 3),
        range(3, 4),
        range(4, 6),
    ]


def test_runs_close_at_the_count_bound() -> None:
    assert chunk_by_bytes([1] * 5, max_count=2, max_bytes=100) == [
        range(0, 2),
        range(2, 4),
        range(4, 5),
    ]
    assert chunk_by_bytes([], max_count=2, max_bytes=100) == []


@given(
    st.lists(st.integers(0, 50), max_size=60),
    st.integers(1, 8),
    st.integers(1, 100),
)
def test_every_item_in_one_run_in_order_within_bounds(
    sizes: list[int], max_count: int, max_bytes: int
) -> None:
    runs = chunk_by_bytes(sizes, max_count, max_bytes)
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    for r in runs:
        assert 1 <= len(r) <= max_count
        assert len(r) == 1 or sum(sizes[i] for i in r) <= max_bytes
