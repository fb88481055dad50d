"""Server-side group commit: many publish requests merged into one append op
(one span each), applied to a real state machine on LMDB."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from node_daemon.raft import Entry, EntryType
from node_daemon.state.machine import StateMachine
from node_daemon.state.responses import OpResult
from node_daemon.storage.raft_log import LmdbLogStorage
from node_daemon.work.appends import MalformedRequest, prepare_appends
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.errors import Code, RoadlogError
from roadlog.geo import Region, bbox_region
from roadlog.v1 import client_pb2, command_pb2, pings_pb2, topics_pb2
from roadlog.validation import BatchRejected

pytestmark = pytest.mark.unit

REGION = bbox_region(11.4, 48.05, 11.75, 48.25)
T0 = 1_800_000_000_000
PARTS = 4


def lookup(name: str) -> tuple[int, Region]:
    if name != "munich":
        raise RoadlogError(Code.NOT_FOUND, f"no topic {name!r}")
    return PARTS, REGION


def request(
    ts: list[int],
    devices: list[str] | None = None,
    lat: float = 48.1,
    producer: int = 0,
    seq: int = 0,
    topic: str = "munich",
) -> bytes:
    n = len(ts)
    cols = PingColumns.from_columns(
        devices or [f"car-{t % 7}" for t in ts], [T0 + t for t in ts], [lat] * n, [11.5] * n
    )
    return client_pb2.PublishRequest(
        topic=topic,
        client_id=f"client-{producer}",
        producer_id=producer,
        sequence=seq,
        batch=pings_pb2.PingBatch.FromString(columnar.encode(cols)),
    ).SerializeToString()


class Replica:
    """A state machine fed ops as committed entries; ``logged``: with its
    node's Raft log, each entry saved there first (batches stored as
    references into it)."""

    def __init__(self, path: Path, logged: bool = False) -> None:
        self.log = LmdbLogStorage(path.with_name(path.name + "-raft")) if logged else None
        self.sm = StateMachine(path, map_size=64 << 20, entries=self.log)
        self.index = 0
        spec = topics_pb2.TopicSpec(name="munich", region_geojson=REGION.geojson, partitions=PARTS)
        self.apply([command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))])
        # The producer ids these tests publish with, issued as InitProducer does.
        self.apply(
            [
                command_pb2.Op(
                    init_producer=command_pb2.InitProducerOp(client_id="t", producer_id=pid)
                )
                for pid in (3, 8, 9)
            ]
        )

    def apply(self, ops: list[command_pb2.Op]) -> list[OpResult]:
        self.index += 1
        cmd = command_pb2.Command(leader_ms=T0, ops=ops)
        entry = Entry(1, self.index, EntryType.NORMAL, cmd.SerializeToString())
        if self.log is not None:
            self.log.save(None, [entry])
        [res] = self.sm.apply([entry])
        return res

    def close(self) -> None:
        self.sm.close()
        if self.log is not None:
            self.log.close()

    def read(self, partition: int) -> list[int]:
        resp = self.sm.fetch(client_pb2.FetchRequest(topic="munich", partition=partition))
        out: list[int] = []
        for b in resp.batches:
            out += (columnar.decode(b.batch).ts_ms - T0).tolist()
        return out


@pytest.fixture(params=[False, True], ids=["bytes", "refs"])
def replica(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Replica]:
    r = Replica(tmp_path / "sm", logged=request.param)
    yield r
    r.close()


def ts_of(resp: client_pb2.PublishResponse, stored: dict[int, list[int]]) -> list[int]:
    """The timestamps the response's offsets point at, partition by partition."""
    out: list[int] = []
    for o in resp.offsets:
        out += stored[o.partition][o.base_offset : o.base_offset + o.count]
    return sorted(out)


def test_requests_merge_into_one_op_and_each_gets_its_own_offsets(replica: Replica) -> None:
    reqs = [request(list(range(k * 100, k * 100 + 100))) for k in range(5)]
    prepared, errors = prepare_appends(reqs, lookup, T0)
    assert errors == {} and len(prepared) == 1
    [p] = prepared
    assert p.members == [0, 1, 2, 3, 4]
    op = p.op.append
    assert len(op.spans) == 5 and sorted(pt.partition for pt in op.parts) == [
        pt.partition for pt in op.parts
    ]
    for i, part in enumerate(op.parts):
        assert part.count == sum(s.counts[i] for s in op.spans)
    [res] = replica.apply([p.op])
    assert len(res.spans) == 5
    stored = {q: replica.read(q) for q in range(PARTS)}
    assert sum(map(len, stored.values())) == 500
    for k, span in enumerate(res.spans):
        assert span.code == Code.OK
        resp = client_pb2.PublishResponse.FromString(span.response)
        assert ts_of(resp, stored) == list(range(k * 100, k * 100 + 100))
        assert resp.applied_index == replica.index
    for q in range(PARTS):  # each device's pings in the order sent
        assert stored[q] == sorted(stored[q])


def test_a_bad_request_is_refused_alone_with_its_own_indexes() -> None:
    good = request([1, 2, 3])
    outside = request([4, 5, 6], lat=40.0)  # far outside Munich
    one_bad = request([7, 8, 9])
    msg = client_pb2.PublishRequest.FromString(one_bad)
    msg.batch.lat[1] = 95.0
    reqs = [good, outside, msg.SerializeToString(), b"\xff\xff garbage", request([10], topic="x")]
    prepared, errors = prepare_appends(reqs, lookup, T0)
    assert sorted(errors) == [1, 2, 3, 4]
    assert [p.members for p in prepared] == [[0]]
    assert isinstance(errors[1], BatchRejected) and errors[1].total_bad == 3
    assert "outside the topic's region" in str(errors[1])
    bad = errors[2]
    assert isinstance(bad, BatchRejected)
    assert [(b.index, b.reason) for b in bad.bad] == [(1, "latitude must be a number in [-90, 90]")]
    assert isinstance(errors[3], MalformedRequest)
    assert isinstance(errors[4], RoadlogError) and errors[4].code == Code.NOT_FOUND
    assert (
        prepared[0].op.append.parts[0].count
        + sum(pt.count for pt in prepared[0].op.append.parts[1:])
        == 3
    )


def test_a_device_index_out_of_range_is_reported_in_a_merge() -> None:
    msg = client_pb2.PublishRequest.FromString(request([1, 2]))
    msg.batch.device_index[1] = 99
    prepared, errors = prepare_appends([request([0]), msg.SerializeToString()], lookup, T0)
    assert [p.members for p in prepared] == [[0]]
    bad = errors[1]
    assert isinstance(bad, BatchRejected) and bad.bad[0].index == 1
    assert "device index" in bad.bad[0].reason


def test_merged_ops_are_bounded_in_pings() -> None:
    reqs = [request(list(range(k * 10, k * 10 + 10))) for k in range(10)]
    prepared, errors = prepare_appends(reqs, lookup, T0, max_pings_per_op=25)
    assert errors == {}
    assert [p.members for p in prepared] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_a_retry_inside_a_merge_is_stored_once(replica: Replica) -> None:
    first = request([1, 2, 3, 4], producer=9, seq=1)
    other = request([5, 6, 7], producer=8, seq=1)
    [p1], _ = prepare_appends([first], lookup, T0)
    [r1] = replica.apply([p1.op])
    original = client_pb2.PublishResponse.FromString(r1.spans[0].response)
    # The retry of seq 1 arrives merged with a new batch of another producer
    # and a new batch (seq 2) of the same producer.
    again = request([11, 12], producer=9, seq=2)
    [p2], _ = prepare_appends([other, first, again, first], lookup, T0)
    [r2] = replica.apply([p2.op])
    answers = [client_pb2.PublishResponse.FromString(s.response) for s in r2.spans]
    assert [a.duplicate for a in answers] == [False, True, False, True]
    assert list(answers[1].offsets) == list(original.offsets)
    stored = {q: replica.read(q) for q in range(PARTS)}
    assert sorted(t for ts in stored.values() for t in ts) == [1, 2, 3, 4, 5, 6, 7, 11, 12]
    assert ts_of(answers[0], stored) == [5, 6, 7] and ts_of(answers[2], stored) == [11, 12]


def test_an_old_sequence_fails_alone(replica: Replica) -> None:
    for seq in range(1, 11):
        [p], _ = prepare_appends([request([seq], devices=["car"], producer=3, seq=seq)], lookup, T0)
        replica.apply([p.op])
    stale = request([99], devices=["car"], producer=3, seq=1)
    fresh = request([100], devices=["car"])
    [p], _ = prepare_appends([stale, fresh], lookup, T0)
    [res] = replica.apply([p.op])
    assert res.spans[0].code == Code.FAILED_PRECONDITION
    assert res.spans[1].code == Code.OK
    stored = [t for q in range(PARTS) for t in replica.read(q)]
    assert 99 not in stored and 100 in stored


def test_inconsistent_spans_are_refused_on_every_replica(replica: Replica) -> None:
    [p], _ = prepare_appends([request([1, 2, 3])], lookup, T0)
    op = command_pb2.Op()
    op.CopyFrom(p.op)
    op.append.spans[0].counts[0] += 1
    [res] = replica.apply([op])
    assert res.code == Code.INVALID_ARGUMENT and "disagree" in res.message
    del op.append.spans[:]
    [res] = replica.apply([op])
    assert res.code == Code.INVALID_ARGUMENT and "without spans" in res.message
    assert [replica.read(q) for q in range(PARTS)] == [[]] * PARTS


def test_join_keeps_each_device_once() -> None:
    a = PingColumns.from_columns(["x", "y"], [1, 2], [48.1, 48.1], [11.5, 11.5])
    b = PingColumns.from_columns(["y", "z", "y"], [3, 4, 5], [48.1] * 3, [11.5] * 3)
    m = columnar.join([columnar.parse(columnar.encode(c)) for c in (a, b)])
    assert sorted(m.device_ids) == ["x", "y", "z"] and len(m.device_ids) == 3
    assert m.device_of().tolist() == ["x", "y", "y", "z", "y"]
    assert np.array_equal(m.ts_ms, [1, 2, 3, 4, 5])
