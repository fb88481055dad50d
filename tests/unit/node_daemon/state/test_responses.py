"""Publish answers written straight as wire bytes are byte for byte what
protobuf writes for the same messages, for any offsets, counts, codes and
texts (zeros left out as protobuf leaves them out)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_daemon.state.responses import publish_batch_response, publish_responses
from roadlog.v1 import client_pb2

pytestmark = pytest.mark.unit

u32 = st.one_of(st.integers(0, 200), st.integers(0, 2**32 - 1))
u64 = st.one_of(st.integers(0, 200), st.integers(0, 2**63))


@st.composite
def appends(draw: st.DrawFn) -> tuple[list[int], list[int], list[list[int]], int]:
    width = draw(st.integers(0, 6))
    partitions = draw(st.lists(u32, min_size=width, max_size=width, unique=True))
    bases = draw(st.lists(u64, min_size=width, max_size=width))
    rows = draw(st.lists(st.lists(u32, min_size=width, max_size=width), max_size=5))
    return partitions, bases, rows, draw(u64)


def expected(
    partitions: list[int], bases: list[int], rows: list[list[int]], index: int, group: int = 0
) -> list[bytes]:
    nxt = list(bases)
    out = []
    for row in rows:
        resp = client_pb2.PublishResponse()
        if group:  # a data group's answer: its index is that group's fence
            resp.group_fences.add(group=group, applied_index=index)
        else:
            resp.applied_index = index
        for i, count in enumerate(row):
            if count:
                resp.offsets.add(partition=partitions[i], base_offset=nxt[i], count=count)
                nxt[i] += count
        out.append(resp.SerializeToString())
    return out


@given(appends())
def test_publish_responses_are_protobufs_bytes(
    case: tuple[list[int], list[int], list[list[int]], int],
) -> None:
    assert publish_responses(*case) == expected(*case)


@given(appends(), st.integers(1, 64))
def test_a_data_groups_answers_carry_its_fence(
    case: tuple[list[int], list[int], list[list[int]], int], group: int
) -> None:
    assert publish_responses(*case, group) == expected(*case, group)


def test_each_span_starts_where_the_one_before_ended() -> None:
    (first, second) = publish_responses([3, 0], [10, 500], [[2, 0], [1, 4]], 77)
    a, b = (
        client_pb2.PublishResponse.FromString(first),
        client_pb2.PublishResponse.FromString(second),
    )
    assert [(o.partition, o.base_offset, o.count) for o in a.offsets] == [(3, 10, 2)]
    assert [(o.partition, o.base_offset, o.count) for o in b.offsets] == [(3, 12, 1), (0, 500, 4)]
    assert a.applied_index == b.applied_index == 77


results = st.lists(
    st.tuples(st.integers(0, 2**31 - 1), st.text(max_size=40), st.binary(max_size=300)),
    max_size=8,
)


@given(results)
def test_publish_batch_response_is_protobufs_bytes(items: list[tuple[int, str, bytes]]) -> None:
    msg = client_pb2.PublishBatchResponseView()
    for code, message, response in items:
        msg.results.add(code=code, message=message, response=response)
    assert publish_batch_response(items) == msg.SerializeToString()
