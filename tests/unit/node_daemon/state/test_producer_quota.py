"""The producer-id quota is checked where an id is issued (issue 39, finding
5), on real LMDB: an InitProducerOp carries the leader's limit
(``max_held``) and the apply refuses a new id for an identity that holds
that many, on every replica alike, so InitProducers proposed side by side
(the leader's early check sees none of them) cannot pass it. Before, only
the leader's check before proposing held it: 64 concurrent calls of one
identity got 1,077 ids against 1,024."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from node_daemon.config import NodeConfig
from node_daemon.state.machine import StateMachine
from node_daemon.state.producers import MAX_PRODUCER_IDS_PER_CLIENT
from node_daemon.state.responses import OpResult
from node_daemon.work.handler import WorkHandler
from roadlog.errors import Code
from roadlog.v1 import client_pb2, command_pb2, work_pb2
from tests.unit.node_daemon.state.test_heatmap_retention import T0, entry

pytestmark = pytest.mark.unit

LIMIT = 4
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def init_op(
    client: str, pid: int, max_held: int = LIMIT, bound: bool = True, renew: bool = False
) -> command_pb2.Op:
    op = command_pb2.InitProducerOp(
        client_id=client, producer_id=pid, bound=bound, max_held=max_held, next_epoch=renew
    )
    return command_pb2.Op(init_producer=op)


class Replica:
    def __init__(self, path: Path) -> None:
        self.sm = StateMachine(path, map_size=64 << 20)
        self.index = 0

    def run(self, *ops: command_pb2.Op) -> list[OpResult]:
        self.index += 1
        [results] = self.sm.apply([entry(self.index, T0, *ops)])
        return results

    def held(self, client: str) -> int:
        return self.sm.producer_ids_held(client, 1000)

    def issued(self, pid: int) -> bool:
        with self.sm.env.begin() as txn:
            return self.sm.producers.issued(txn, pid)


@pytest.fixture
def r(tmp_path: Path) -> Iterator[Replica]:
    rep = Replica(tmp_path / "sm")
    yield rep
    rep.sm.close()


def test_the_apply_refuses_the_id_past_the_quota_and_stores_nothing_of_it(r: Replica) -> None:
    for pid in range(1, LIMIT + 1):
        [res] = r.run(init_op("alice", pid))
        assert res.code == Code.OK, res.message
    [refused] = r.run(init_op("alice", 100))
    assert refused.code == Code.RESOURCE_EXHAUSTED
    # "quota:": the SDK raises it at once; the message says what frees one.
    assert f"producer id quota: this identity holds {LIMIT} producer ids" in refused.message
    assert "next epoch" in refused.message
    assert not r.issued(100) and r.held("alice") == LIMIT
    # Another identity is not affected; the holder may still renew an id it
    # holds (its next epoch takes no new one).
    [other] = r.run(init_op("bob", 200))
    [renewed] = r.run(init_op("alice", 1, renew=True))
    assert other.code == Code.OK and renewed.code == Code.OK, renewed.message
    assert client_pb2.InitProducerResponse.FromString(renewed.response).epoch == 1


def test_ids_proposed_side_by_side_in_one_entry_stop_at_the_quota(r: Replica) -> None:
    results = r.run(*(init_op("alice", pid) for pid in range(1, 2 * LIMIT + 1)))
    codes = [res.code for res in results]
    assert codes == [Code.OK] * LIMIT + [Code.RESOURCE_EXHAUSTED] * LIMIT
    assert r.held("alice") == LIMIT
    assert [r.issued(pid) for pid in range(1, 2 * LIMIT + 1)] == [True] * LIMIT + [False] * LIMIT


def test_entries_from_before_the_check_and_unbound_ids_are_not_refused(r: Replica) -> None:
    """An op without ``max_held`` (a log written before this check) is
    applied as it was then, so a replica replaying it agrees with what was
    answered; an id issued without an identity counts against none."""
    for pid in range(1, LIMIT + 3):
        [res] = r.run(init_op("alice", pid, max_held=0))
        assert res.code == Code.OK
    assert r.held("alice") == LIMIT + 2
    [refused] = r.run(init_op("alice", 99))  # a new entry: the quota holds again
    assert refused.code == Code.RESOURCE_EXHAUSTED
    for pid in range(200, 200 + LIMIT + 1):
        [res] = r.run(init_op("anyone", pid, bound=False))
        assert res.code == Code.OK


def test_replicas_fed_the_same_entries_refuse_the_same_ids(tmp_path: Path) -> None:
    a, b = Replica(tmp_path / "a"), Replica(tmp_path / "b")
    try:
        answers = []
        for rep in (a, b):
            codes = [res.code for res in rep.run(*(init_op("alice", p) for p in range(1, 7)))]
            codes += [res.code for res in rep.run(init_op("alice", 7), init_op("bob", 8))]
            answers.append(codes)
        assert answers[0] == answers[1]
        assert answers[0].count(Code.OK) == LIMIT + 1  # alice's four, and bob's
        assert a.sm.digest() == b.sm.digest()
    finally:
        a.sm.close()
        b.sm.close()


def test_the_default_quota_is_the_nodes_default() -> None:
    assert NodeConfig().producer_ids_per_identity == MAX_PRODUCER_IDS_PER_CLIENT == 1024


def test_concurrent_init_producers_of_one_identity_get_at_most_the_quota(r: Replica) -> None:
    """Through the leader's WorkHandler: 64 InitProducers of one identity
    all pass its early check (none is applied yet) and are proposed side by
    side; the log then applies them, and only the quota's worth get ids."""
    calls = 64
    proposed: list[tuple[command_pb2.Op, asyncio.Future[OpResult]]] = []

    async def run() -> list[work_pb2.WorkResult]:
        all_proposed = asyncio.Event()

        class Leader:
            sm = r.sm
            cfg = NodeConfig(producer_ids_per_identity=LIMIT)

            async def propose_op(
                self, op: command_pb2.Op, deadline: float | None = None
            ) -> OpResult:
                fut: asyncio.Future[OpResult] = asyncio.get_running_loop().create_future()
                proposed.append((op, fut))
                if len(proposed) == calls:
                    all_proposed.set()
                return await fut

        handler = WorkHandler(Leader())  # type: ignore[arg-type]
        req = client_pb2.InitProducerRequest().SerializeToString()
        item = work_pb2.WorkItem(id=1, method="InitProducer", request=req, principal="alice")
        tasks = [asyncio.create_task(handler.run(item)) for _ in range(calls)]
        await all_proposed.wait()
        # Committed in a few entries, as a leader batches what came together.
        for start in range(0, calls, 16):
            chunk = proposed[start : start + 16]
            for (_, fut), res in zip(chunk, r.run(*(op for op, _ in chunk)), strict=True):
                fut.set_result(res)
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert all(op.init_producer.max_held == LIMIT for op, _ in proposed)
    granted = [res for res in results if res.code == 0]
    assert len(granted) == LIMIT, [res.message for res in results if res.code][:3]
    assert {res.code for res in results if res.code} == {EXHAUSTED}
    assert r.held("alice") == LIMIT
