"""Per-client records expire (issue 19, finding 10), on real LMDB: a trim op
with ``expire_records`` forgets contributions older than their topic's
retention and producer records whose batches retention deleted; the
producer ids the leader lists are forgotten where no record is left; what
one identity holds is counted for its quota. Replicas that apply the same
entries stay identical, and one that missed an expiry (a node of an earlier
release) holds the same records as the others again after its next one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from node_daemon.config import NodeConfig
from node_daemon.state.machine import StateMachine, append_op, trim_op
from node_daemon.state.producers import PRODUCER_ID_LIFETIME_MS
from node_daemon.state.responses import OpResult
from node_daemon.work.handler import WorkHandler
from roadlog.columnar import PingColumns
from roadlog.errors import Code
from roadlog.partitioning import split_by_partition
from roadlog.v1 import client_pb2, command_pb2, work_pb2
from tests.unit.node_daemon.state.test_heatmap_retention import HOUR, T0, create_op, entry

pytestmark = pytest.mark.unit

DAY = 24 * HOUR


class Replica:
    def __init__(self, path: Path) -> None:
        self.sm = StateMachine(path, map_size=64 << 20)
        self.index = 0

    def run(self, leader_ms: int, *ops: command_pb2.Op) -> list[Code]:
        self.index += 1
        [results] = self.sm.apply([entry(self.index, leader_ms, *ops)])
        return [(r.spans[0] if r.spans else r).code for r in results]

    def issue(self, pid: int, client: str, at_ms: int) -> None:
        op = command_pb2.InitProducerOp(client_id=client, producer_id=pid, bound=True)
        assert self.run(at_ms, command_pb2.Op(init_producer=op)) == [Code.OK]

    def publish(self, client: str, at_ms: int, producer: int = 0, seq: int = 0) -> Code:
        cols = PingColumns.from_columns(["car-1", "car-2"], [at_ms] * 2, [48.1] * 2, [11.5] * 2)
        op = append_op("munich", split_by_partition(cols, 2), producer, seq, client_id=client)
        [code] = self.run(at_ms, op)
        return code

    def contributors(self) -> set[str]:
        tid = self.sm.topic("munich").id
        with self.sm.env.begin() as txn:
            return {
                c
                for c in ("alice", "bob", "carol")
                if self.sm.heat.last_contribution(txn, tid, c) is not None
            }

    def producer_records(self) -> int:
        with self.sm.env.begin() as txn:
            return sum(1 for _ in txn.cursor(db=self.sm.producers.records))

    def issued(self, pid: int) -> bool:
        with self.sm.env.begin() as txn:
            return self.sm.producers.issued(txn, pid)


@pytest.fixture
def r(tmp_path: Path) -> Iterator[Replica]:
    rep = Replica(tmp_path / "sm")
    rep.run(T0, create_op("munich", retention_ms=DAY))
    yield rep
    rep.sm.close()


def test_contributions_older_than_retention_are_forgotten(r: Replica) -> None:
    assert r.publish("alice", T0) == Code.OK
    assert r.publish("bob", T0 + 12 * HOUR) == Code.OK
    r.run(T0 + 25 * HOUR, trim_op(expire_records=False))  # an old release's trim keeps them
    assert r.contributors() == {"alice", "bob"}
    r.run(T0 + 25 * HOUR, trim_op())  # alice's is 25 h old, the retention a day
    assert r.contributors() == {"bob"}
    r.run(T0 + 37 * HOUR, trim_op())
    assert r.contributors() == set()


def test_producer_records_go_once_retention_deleted_their_batches(r: Replica) -> None:
    r.issue(7, "alice", T0)
    r.issue(8, "bob", T0)
    assert r.publish("alice", T0, producer=7, seq=1) == Code.OK
    assert r.publish("bob", T0 + 12 * HOUR, producer=8, seq=1) == Code.OK
    records = r.producer_records()
    assert records >= 2
    r.run(T0 + 25 * HOUR, trim_op())  # alice's batches are past retention, bob's are not
    assert 0 < r.producer_records() < records
    # Both ids are still issued (each has its lifetime) and alice's still works.
    assert r.issued(7) and r.issued(8)
    # Idempotence holds for what retention kept: bob's retry is stored once.
    cols = PingColumns.from_columns(
        ["car-1", "car-2"], [T0 + 12 * HOUR] * 2, [48.1] * 2, [11.5] * 2
    )
    retry = append_op("munich", split_by_partition(cols, 2), 8, 1, client_id="bob")
    r.index += 1
    [[res]] = r.sm.apply([entry(r.index, T0 + 25 * HOUR, retry)])
    (span,) = res.spans
    assert span.code == Code.OK and client_pb2.PublishResponse.FromString(span.response).duplicate
    assert r.publish("alice", T0 + 25 * HOUR, producer=7, seq=2) == Code.OK


def test_listed_producer_ids_are_forgotten_only_without_records(r: Replica) -> None:
    r.issue(7, "alice", T0)  # never used
    r.issue(8, "alice", T0)  # used, its pings within retention
    r.issue(9, "alice", T0 + PRODUCER_ID_LIFETIME_MS)  # young
    assert r.publish("alice", T0 + PRODUCER_ID_LIFETIME_MS, producer=8, seq=1) == Code.OK
    assert r.sm.producer_ids_held("alice") == 3 and r.sm.producer_ids_held("bob") == 0
    r.run(T0 + PRODUCER_ID_LIFETIME_MS + HOUR, trim_op())
    assert r.sm.expirable_producers() == [7]
    # The leader lists 7 and 8 (8 got a record meanwhile, say): 8 is kept.
    r.run(T0 + PRODUCER_ID_LIFETIME_MS + HOUR, trim_op(expired_producers=[7, 8, 12345]))
    assert not r.issued(7) and r.issued(8) and r.issued(9)
    assert r.sm.producer_ids_held("alice") == 2
    code = r.publish("alice", T0 + PRODUCER_ID_LIFETIME_MS + HOUR, producer=7, seq=1)
    assert code == Code.FAILED_PRECONDITION  # "unknown producer id": ask for a new one
    assert r.sm.expirable_producers() == []


def test_a_replica_that_missed_an_expiry_is_identical_after_its_next_one(tmp_path: Path) -> None:
    a, b = Replica(tmp_path / "a"), Replica(tmp_path / "b")
    try:
        for rep in (a, b):
            rep.run(T0, create_op("munich", retention_ms=DAY))
            rep.issue(7, "alice", T0)
            assert rep.publish("alice", T0, producer=7, seq=1) == Code.OK
            assert rep.publish("bob", T0 + 1 * HOUR) == Code.OK
        a.run(T0 + 25 * HOUR, trim_op())
        b.run(T0 + 25 * HOUR, trim_op(expire_records=False))  # as an earlier release
        assert a.sm.digest() != b.sm.digest()
        for rep in (a, b):
            rep.run(T0 + 26 * HOUR, trim_op())
        assert a.sm.digest() == b.sm.digest()
        assert a.contributors() == set() and a.producer_records() == 0
    finally:
        a.sm.close()
        b.sm.close()


def test_an_identity_gets_no_more_producer_ids_than_its_quota(r: Replica) -> None:
    """The leader refuses InitProducer for an identity at its quota
    (``producer_ids_per_identity``) with RESOURCE_EXHAUSTED, before
    proposing; another identity is not affected; each op it proposes
    carries the quota for the apply to check again."""
    proposed: list[command_pb2.Op] = []

    class Leader:
        sm = r.sm
        cfg = NodeConfig(producer_ids_per_identity=2)

        async def propose_op(self, op: command_pb2.Op, deadline: float | None = None) -> OpResult:
            proposed.append(op)
            ip = op.init_producer
            if not ip.next_epoch:  # a new id (a renewal issues none)
                r.issue(ip.producer_id, ip.client_id, T0)
            return OpResult()

    async def init(principal: str, resume: int = 0) -> work_pb2.WorkResult:
        handler = WorkHandler(Leader())  # type: ignore[arg-type]
        req = client_pb2.InitProducerRequest(client_id="declared", producer_id=resume)
        item = work_pb2.WorkItem(
            id=1, method="InitProducer", request=req.SerializeToString(), principal=principal
        )
        return await handler.run(item)

    codes = [asyncio.run(init("alice")).code for _ in range(3)]
    assert codes[:2] == [0, 0] and codes[2] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    refused = asyncio.run(init("alice"))
    # "quota:": the SDK raises it at once instead of retrying until its timeout.
    assert "producer id quota: this identity holds 2 producer ids" in refused.message
    assert asyncio.run(init("bob")).code == 0
    assert [op.init_producer.client_id for op in proposed] == ["alice", "alice", "bob"]
    assert [op.init_producer.max_held for op in proposed] == [2, 2, 2]
    # Resuming an id it holds (its next epoch) takes no new one: not refused.
    held = proposed[0].init_producer.producer_id
    assert asyncio.run(init("alice", resume=held)).code == 0
    assert proposed[-1].init_producer.next_epoch and proposed[-1].init_producer.producer_id == held
