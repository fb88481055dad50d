"""A publish split across data groups (multi-raft step 3): group 0's leader
regroups an append op's parts by group (``split_by_group``: every ping in
exactly one group's op, every span's counts cut to its group's parts, no
empty span), and the queue server merges the parts' answers into each
publish's (``queue_server.parts.merge``: OK only if every part stored it,
offsets of all parts, duplicate only if every part was one, a fence per
group)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_daemon.state.responses import publish_batch_response
from node_daemon.work.appends import split_by_group
from queue_server.parts import merge, replayable_part
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, command_pb2, work_pb2

pytestmark = pytest.mark.unit


def op_of(counts: list[list[int]], partitions: list[int]) -> command_pb2.AppendOp:
    op = command_pb2.AppendOp(topic="munich")
    for i, p in enumerate(partitions):
        total = sum(row[i] for row in counts)
        op.parts.add(partition=p, batch=bytes([p]) * total, count=total)
    for j, row in enumerate(counts):
        op.spans.add(client_id=f"c{j}", producer_id=j + 1, sequence=7, counts=row)
    return op


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda nparts: st.tuples(
            st.lists(st.integers(1, 4), min_size=nparts, max_size=nparts),  # groups
            st.lists(  # spans: counts per part, none all zero
                st.lists(st.integers(0, 5), min_size=nparts, max_size=nparts).filter(any),
                min_size=1,
                max_size=6,
            ),
        )
    )
)
def test_every_ping_goes_to_exactly_one_group(case: tuple[list[int], list[list[int]]]) -> None:
    groups, counts = case
    partitions = list(range(len(groups)))
    op = op_of(counts, partitions)
    split = split_by_group(op, groups, topic_id=9)
    assert [g for g, _, _ in split] == sorted(set(groups))
    seen: dict[int, int] = {}
    for g, sub, members in split:
        assert sub.topic == "munich" and sub.topic_id == 9
        assert all(groups[part.partition] == g for part in sub.parts)
        assert len(members) == len(sub.spans) and members == sorted(members)
        for part in sub.parts:
            seen[part.partition] = seen.get(part.partition, 0) + 1
            assert part.batch == op.parts[part.partition].batch  # as it was: no re-encoding
        for span, j in zip(sub.spans, members, strict=True):
            assert any(span.counts)  # no empty span
            assert span.producer_id == op.spans[j].producer_id
            cut = [op.spans[j].counts[part.partition] for part in sub.parts]
            assert list(span.counts) == cut
        for i, part in enumerate(sub.parts):  # the op's invariant holds per group
            assert part.count == sum(span.counts[i] for span in sub.spans)
    assert seen == {p: 1 for p in partitions}
    # Every span's pings, over all groups, are all of them.
    for j, row in enumerate(counts):
        total = sum(
            sum(span.counts)
            for _, sub, members in split
            for span, m in zip(sub.spans, members, strict=True)
            if m == j
        )
        assert total == sum(row)


def span_answer(
    partitions: list[tuple[int, int, int]], index: int, duplicate: bool = False
) -> bytes:
    resp = client_pb2.PublishResponse(applied_index=index, duplicate=duplicate)
    for p, base, count in partitions:
        resp.offsets.add(partition=p, base_offset=base, count=count)
    return resp.SerializeToString()


def ok(*spans: bytes) -> work_pb2.WorkResult:
    return work_pb2.WorkResult(response=publish_batch_response([(0, "", s) for s in spans]))


def test_a_batch_is_answered_per_publish_from_every_part() -> None:
    refusals = publish_batch_response([(0, "", b""), (3, "bad ping 5: lat", b""), (0, "", b"")])
    parts = [
        work_pb2.WorkPart(group=1, members=[0, 2]),
        work_pb2.WorkPart(group=2, members=[0]),
    ]
    results = [
        ok(span_answer([(0, 10, 4)], 40), span_answer([(3, 0, 2)], 41, duplicate=True)),
        ok(span_answer([(1, 5, 6)], 17)),
    ]
    out = client_pb2.PublishBatchResponse.FromString(merge(False, refusals, parts, results))
    first, refused, third = out.results
    assert first.code == 0 and [(o.partition, o.count) for o in first.response.offsets] == [
        (0, 4),
        (1, 6),
    ]
    assert [(f.group, f.applied_index) for f in first.response.group_fences] == [(1, 40), (2, 17)]
    assert first.response.applied_index == 0 and not first.response.duplicate
    assert refused.code == 3 and "lat" in refused.message
    assert third.response.duplicate  # its only part was a retry of one stored


def test_a_part_that_failed_fails_its_publishes_only() -> None:
    refusals = publish_batch_response([(0, "", b""), (0, "", b"")])
    parts = [
        work_pb2.WorkPart(group=1, members=[0, 1]),
        work_pb2.WorkPart(group=3, members=[1]),
    ]
    results = [
        ok(span_answer([(0, 0, 1)], 5), span_answer([(0, 1, 1)], 5)),
        work_pb2.WorkResult(code=Code.UNAVAILABLE, message="no leader of group 3"),
    ]
    out = client_pb2.PublishBatchResponse.FromString(merge(False, refusals, parts, results))
    assert out.results[0].code == 0
    assert out.results[1].code == Code.UNAVAILABLE and "group 3" in out.results[1].message


def test_a_lone_publish_raises_its_first_refusal() -> None:
    parts = [work_pb2.WorkPart(group=1, members=[0]), work_pb2.WorkPart(group=2, members=[0])]
    good = ok(span_answer([(0, 0, 3)], 9))
    refused = work_pb2.WorkResult(
        response=publish_batch_response([(Code.FAILED_PRECONDITION, "fenced", b"")])
    )
    with pytest.raises(RoadlogError, match="fenced") as err:
        merge(True, b"", parts, [good, refused])
    assert err.value.code == Code.FAILED_PRECONDITION
    resp = client_pb2.PublishResponse.FromString(merge(True, b"", parts, [good, good]))
    assert resp.offsets[0].count == 3 and len(resp.offsets) == 2


def test_an_answer_that_does_not_match_its_part_is_an_error_not_a_guess() -> None:
    parts = [work_pb2.WorkPart(group=1, members=[0])]
    two = ok(span_answer([(0, 0, 1)], 1), span_answer([(1, 0, 1)], 1))
    with pytest.raises(RoadlogError) as err:
        merge(True, b"", parts, [two])
    assert err.value.code == Code.INTERNAL
    with pytest.raises(RoadlogError, match="names a publish"):
        merge(True, b"", [work_pb2.WorkPart(group=1, members=[3])], [ok(span_answer([], 1))])


def test_only_parts_of_idempotent_publishes_are_handed_out_again() -> None:
    both = op_of([[1, 0], [0, 2]], [0, 1])
    assert replayable_part(both.SerializeToString())
    both.spans[1].producer_id = 0
    assert not replayable_part(both.SerializeToString())
