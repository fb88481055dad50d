"""A data group's appends (multi-raft step 3): producer ids are issued in
group 0, so a data group's leader checks each publish's producer id against
its node's replica of group 0 before proposing (unknown: refused; bound to
another identity: refused; group 0 a moment behind: waited for), and its
state machine, which issues none, takes the checked spans. Real LMDB for
both groups; the Raft nodes are stubs that apply proposals at once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from node_daemon.raft import Entry, EntryType
from node_daemon.replica.replica import NotLeader
from node_daemon.state.machine import StateMachine
from node_daemon.state.responses import OpResult
from node_daemon.store.data_group_topics import next_topic_op
from node_daemon.work.handler import WorkHandler
from roadlog.columnar import PingColumns, encode
from roadlog.v1 import client_pb2, command_pb2, pings_pb2, work_pb2
from tests.unit.node_daemon.state.test_state_machine import Log

pytestmark = pytest.mark.unit

T0 = 1_800_000_000_000


class Group:
    """A Raft group's replica that commits what is proposed at once."""

    def __init__(self, sm: StateMachine, group: int) -> None:
        self.sm, self.group = sm, group
        self.index = sm.applied_index
        self.cfg = SimpleNamespace(merge_publishes=False)
        self.core = SimpleNamespace(lead=1, log=SimpleNamespace(committed=self.index))
        self.is_leader = True
        self.raft_groups: dict[int, Any] = {}

    def commit(self, op: command_pb2.Op) -> OpResult:
        self.index = max(self.index, self.sm.applied_index) + 1
        self.core.log.committed = self.index
        cmd = command_pb2.Command(leader_ms=T0, ops=[op])
        [[res]] = self.sm.apply([Entry(1, self.index, EntryType.NORMAL, cmd.SerializeToString())])
        return res

    async def propose_op(self, op: command_pb2.Op, deadline: float | None = None) -> OpResult:
        return self.commit(op)

    async def proposals_taken(self) -> None:
        return None

    def committed_index(self) -> int:
        """As Replica's: the commit index this replica knows of."""
        return int(self.core.log.committed)

    async def read_barrier(self) -> int:
        """As Replica's: a linearizable read point (here the commit index
        this replica knows), once applied."""
        index = self.committed_index()
        await self.wait_applied(index, 10)
        return index

    async def wait_applied(self, index: int, timeout: float) -> None:
        """As Replica's: until this replica applied ``index``."""
        deadline = time.monotonic() + timeout
        while self.sm.applied_index < index:
            if time.monotonic() > deadline:
                raise TimeoutError
            await asyncio.sleep(0.01)


def publish(pid: int, seq: int, n: int = 6) -> bytes:
    now = int(time.time() * 1000)
    cols = PingColumns.from_columns(
        [f"car-{i % 3}" for i in range(n)], [now - i for i in range(n)], [48.1] * n, [11.5] * n
    )
    batch = pings_pb2.PingBatch.FromString(encode(cols))
    return client_pb2.PublishRequest(
        topic="munich", producer_id=pid, sequence=seq, batch=batch
    ).SerializeToString()


@pytest.fixture
def groups(tmp_path: Path) -> Any:
    meta = Group(StateMachine(tmp_path / "meta"), 0)
    data = Group(StateMachine(tmp_path / "data", issues_producers=False), 1)
    meta.raft_groups = data.raft_groups = {0: meta, 1: data}
    record = Log(meta.sm).create("munich", partitions=4).topic
    del record.partition_groups[:]
    record.partition_groups.extend([1, 1, 1, 1])
    op = next_topic_op({"munich": record}, data.sm.topic_records(), 1)
    assert op is not None and data.commit(op).code == 0
    yield meta, data
    meta.sm.close()
    data.sm.close()


def issue(meta: Group, pid: int, client: str) -> None:
    op = command_pb2.InitProducerOp(client_id=client, producer_id=pid, bound=True)
    assert meta.commit(command_pb2.Op(init_producer=op)).code == 0


def run(data: Group, request: bytes, principal: str) -> work_pb2.WorkResult:
    async def go() -> work_pb2.WorkResult:
        item = work_pb2.WorkItem(
            id=1, method="Publish", request=request, principal=principal, group=1
        )
        return await WorkHandler(data).run(item)  # type: ignore[arg-type]

    return asyncio.run(go())


def stored(data: Group) -> int:
    """Pings stored in the data group (each partition's end offset)."""
    return sum(
        data.sm.fetch(client_pb2.FetchRequest(topic="munich", partition=p)).end_offset
        for p in range(4)
    )


def test_a_data_group_takes_only_producer_ids_group_0_issued_to_the_sender(
    groups: tuple[Group, Group],
) -> None:
    meta, data = groups
    unknown = run(data, publish(77, 0), "alice")
    assert unknown.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "unknown producer id 77" in unknown.message
    issue(meta, 77, "alice")
    stolen = run(data, publish(77, 0), "mallory")
    assert stolen.code == grpc.StatusCode.PERMISSION_DENIED.value[0], stolen.message
    assert stored(data) == 0
    ok = run(data, publish(77, 0), "alice")
    assert ok.code == 0, ok.message
    again = run(data, publish(77, 0), "alice")  # a retry: stored once, its first offsets
    first, second = (client_pb2.PublishResponse.FromString(r.response) for r in (ok, again))
    assert second.duplicate and list(second.offsets) == list(first.offsets)
    assert stored(data) == 6
    plain = run(data, publish(0, 0), "bob")  # no producer id: nothing to check
    assert plain.code == 0 and stored(data) == 12


def test_an_id_group_0_commits_a_moment_later_is_waited_for(
    groups: tuple[Group, Group],
) -> None:
    """Group 0 committed the id (it was acknowledged) but this node's
    replica has not applied it yet: the leader waits for it."""
    meta, data = groups
    op = command_pb2.InitProducerOp(client_id="alice", producer_id=88, bound=True)
    cmd = command_pb2.Command(leader_ms=T0, ops=[command_pb2.Op(init_producer=op)])
    index = meta.sm.applied_index + 1
    entry = Entry(1, index, EntryType.NORMAL, cmd.SerializeToString())
    meta.core.log.committed = index  # known committed, not applied

    async def go() -> work_pb2.WorkResult:
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, lambda: meta.sm.apply([entry]))
        item = work_pb2.WorkItem(id=1, method="Publish", request=publish(88, 0), principal="alice")
        return await WorkHandler(data).run(item)  # type: ignore[arg-type]

    res = asyncio.run(go())
    assert res.code == 0, res.message
    assert stored(data) == 6


def test_an_unknown_id_that_cannot_be_confirmed_now_is_unavailable_not_refused(
    groups: tuple[Group, Group], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group 0 has no leader to confirm an id this replica does not know:
    the publish is answered UNAVAILABLE (tried again), not refused as an
    unknown producer (final for the client)."""
    meta, data = groups

    async def no_leader() -> int:
        raise NotLeader(0)

    monkeypatch.setattr(meta, "read_barrier", no_leader)
    res = run(data, publish(99, 0), "alice")
    assert res.code == grpc.StatusCode.UNAVAILABLE.value[0], res.message
    assert "producer id 99" in res.message and stored(data) == 0


def test_an_epoch_group_0_moved_on_a_moment_ago_is_fenced_here_too(
    groups: tuple[Group, Group],
) -> None:
    """Another instance took the id under its next epoch; group 0 committed
    it (the new instance was answered) but this node's replica of group 0
    has not applied it yet, and the new epoch wrote nothing to this group:
    the old instance's next publish is refused as fenced, not stored (the
    leader judges after a linearizable read of group 0)."""
    meta, data = groups
    issue(meta, 77, "alice")
    assert run(data, publish(77, 0), "alice").code == 0
    op = command_pb2.InitProducerOp(client_id="alice", producer_id=77, next_epoch=True)
    cmd = command_pb2.Command(leader_ms=T0, ops=[command_pb2.Op(init_producer=op)])
    index = meta.sm.applied_index + 1
    entry = Entry(1, index, EntryType.NORMAL, cmd.SerializeToString())
    meta.core.log.committed = index  # known committed, not applied

    async def go() -> work_pb2.WorkResult:
        asyncio.get_running_loop().call_later(0.1, lambda: meta.sm.apply([entry]))
        item = work_pb2.WorkItem(id=1, method="Publish", request=publish(77, 1), principal="alice")
        return await WorkHandler(data).run(item)  # type: ignore[arg-type]

    res = asyncio.run(go())
    assert res.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], res.message
    assert "fenced" in res.message and stored(data) == 6
