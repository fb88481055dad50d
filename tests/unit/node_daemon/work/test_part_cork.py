"""Parts of split publishes corked at a data group's leader (issue 42): the
parts that reach it in one turn are merged per topic into one AppendOp
when their partitions do not overlap (``part_cork``) and proposed once;
each part is answered with its own spans' results, which are those it
would get proposed alone, and the stored pings are the same, in the same
order. A part that is not sound is proposed alone and refused alone. Real
LMDB; the Raft node is a stub that applies proposals at once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from node_daemon.state.machine import StateMachine
from node_daemon.state.responses import OpResult
from node_daemon.store.data_group_topics import next_topic_op
from node_daemon.work import part_cork
from node_daemon.work.handler import WorkHandler
from roadlog import columnar
from roadlog.columnar import PingColumns, encode
from roadlog.v1 import client_pb2, command_pb2, work_pb2
from tests.unit.node_daemon.state.test_state_machine import Log
from tests.unit.node_daemon.work.test_data_group_appends import Group

pytestmark = pytest.mark.unit


class Counting(Group):
    """A data group's replica that counts the ops proposed to it."""

    def __init__(self, sm: StateMachine, group: int) -> None:
        super().__init__(sm, group)
        self.proposed: list[command_pb2.Op] = []

    async def propose_op(self, op: command_pb2.Op, deadline: float | None = None) -> OpResult:
        self.proposed.append(op)
        return self.commit(op)

    async def wait_caught_up_as_leader(self, timeout: float) -> None:
        return None


def data_group(path: Path) -> Counting:
    meta = Group(StateMachine(path / "meta"), 0)
    data = Counting(StateMachine(path / "data", issues_producers=False), 1)
    meta.raft_groups = data.raft_groups = {0: meta, 1: data}
    record = Log(meta.sm).create("munich", partitions=4).topic
    del record.partition_groups[:]
    record.partition_groups.extend([1, 1, 1, 1])
    op = next_topic_op({"munich": record}, data.sm.topic_records(), 1)
    assert op is not None and data.commit(op).code == 0
    data.topic_id = record.id  # type: ignore[attr-defined]
    meta.sm.close()
    return data


def batch(tag: str, n: int) -> bytes:
    now = int(time.time() * 1000)
    devices = [f"{tag}-{i % 2}" for i in range(n)]
    return encode(
        PingColumns.from_columns(devices, [now - i for i in range(n)], [48.1] * n, [11.5] * n)
    )


def part(
    topic_id: int, tag: str, partitions: list[int], spans: list[list[int]], pid: int = 0
) -> bytes:
    """An AppendPart's AppendOp: ``spans[j][i]`` pings of publish j in
    ``partitions[i]``; with ``pid``, span j is (pid, j) of that producer."""
    op = command_pb2.AppendOp(topic="munich", topic_id=topic_id)
    for i, p in enumerate(partitions):
        n = sum(row[i] for row in spans)
        op.parts.add(partition=p, batch=batch(f"{tag}{p}", n), count=n)
    for j, row in enumerate(spans):
        op.spans.add(client_id=tag, producer_id=pid, sequence=j if pid else 0, counts=row)
    return op.SerializeToString()


def run_together(data: Counting, requests: list[bytes]) -> list[work_pb2.WorkResult]:
    """The parts as the items of one WorkItems frame: tasks of one turn."""

    async def go() -> list[work_pb2.WorkResult]:
        handler = WorkHandler(data)  # type: ignore[arg-type]
        items = [
            work_pb2.WorkItem(
                id=k + 1, kind=work_pb2.WORK_KIND_WRITE, method="AppendPart", request=r, group=1
            )
            for k, r in enumerate(requests)
        ]
        return list(await asyncio.gather(*(handler.run(it) for it in items)))

    return asyncio.run(go())


def answers(res: work_pb2.WorkResult) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """Per span: its code and its (partition, offset, count)s."""
    out = []
    for r in client_pb2.PublishBatchResponse.FromString(res.response).results:
        offs = [(o.partition, o.base_offset, o.count) for o in r.response.offsets]
        out.append((r.code, sorted(offs)))
    return out


def pings(data: Counting) -> dict[int, list[str]]:
    """Each partition's stored pings' device ids, in offset order."""
    out: dict[int, list[str]] = {}
    for p in range(4):
        resp = data.sm.fetch(client_pb2.FetchRequest(topic="munich", partition=p, max_pings=10_000))
        ids: list[str] = []
        for b in resp.batches:
            cols = columnar.decode(b.batch)
            ids += [cols.device_ids[i] for i in cols.device_index.tolist()]
        out[p] = ids
    return out


def test_parts_of_one_turn_are_one_op_answered_as_if_alone(tmp_path: Path) -> None:
    corked, alone = data_group(tmp_path / "corked"), data_group(tmp_path / "alone")
    tid = corked.topic_id  # type: ignore[attr-defined]
    requests = [
        part(tid, "a", [0, 2], [[3, 1], [2, 0]]),  # two publishes
        part(tid, "b", [0, 2, 3], [[1, 4, 2]], pid=41),  # overlaps a's partitions
        part(tid, "c", [1], [[5], [2], [1]]),  # a partition of its own: corked with b
    ]
    together = run_together(corked, requests)
    assert len(corked.proposed) == 2  # a alone (b shares its partitions), b and c as one
    op = corked.proposed[1]
    assert [p.partition for p in op.append.parts] == [0, 2, 3, 1]
    assert len(op.append.spans) == 4
    one_by_one = [run_together(alone, [r])[0] for r in requests]
    assert len(alone.proposed) == 3
    for got, want in zip(together, one_by_one, strict=True):
        assert got.code == 0, got.message
        assert [len(a[1]) for a in answers(got)] == [len(a[1]) for a in answers(want)]
        assert answers(got) == answers(want)
    assert pings(corked) == pings(alone)


def test_a_retried_part_in_the_same_turn_is_stored_once(tmp_path: Path) -> None:
    data = data_group(tmp_path)
    tid = data.topic_id  # type: ignore[attr-defined]
    first = part(tid, "p", [0, 1], [[2, 2]], pid=9)
    [a, b] = run_together(data, [first, first])  # a retry beside the original
    assert len(data.proposed) == 2  # the same partitions: not merged
    ra, rb = (client_pb2.PublishBatchResponse.FromString(r.response).results[0] for r in (a, b))
    assert ra.code == 0 and rb.code == 0
    assert rb.response.duplicate and list(rb.response.offsets) == list(ra.response.offsets)
    assert sum(len(v) for v in pings(data).values()) == 4


def test_a_refused_part_refuses_only_its_publishes(tmp_path: Path) -> None:
    data = data_group(tmp_path)
    tid = data.topic_id  # type: ignore[attr-defined]
    bad = command_pb2.AppendOp.FromString(part(tid, "x", [0], [[3]]))
    bad.parts[0].count = 5  # disagrees with its span
    requests = [
        part(tid, "a", [0, 1], [[1, 1]]),
        bad.SerializeToString(),
        part(tid, "b", [2, 3], [[2, 2], [1, 0]]),
    ]
    ok_a, refused, ok_b = run_together(data, requests)
    assert len(data.proposed) == 2  # a and b corked; the bad one alone
    assert [r.code for r in (ok_a, ok_b)] == [0, 0]
    assert all(code == 0 for code, _ in answers(ok_a) + answers(ok_b))
    codes = [code for code, _ in answers(refused)] or [refused.code]
    assert all(code != 0 for code in codes), refused
    assert [len(v) for v in pings(data).values()] == [1, 1, 3, 2]


def test_corks_keep_topics_apart_partitions_disjoint_and_pings_bounded() -> None:
    def op(topic: str, n: int, tid: int = 1, partition: int = 0) -> command_pb2.AppendOp:
        o = command_pb2.AppendOp(topic=topic, topic_id=tid)
        o.parts.add(partition=partition, batch=b"x", count=n)
        o.spans.add(counts=[n])
        return o

    ops = [
        op("a", 10),
        op("b", 5),
        op("a", 20, partition=1),
        op("a", 30, partition=2),  # 60 pings with the two before: over the bound
        op("a", 5, partition=2),  # shares partition 2 with the group open
        op("a", 1, tid=2, partition=3),
    ]
    assert part_cork.corks(ops, max_pings=40) == [[0, 2], [1], [3], [4], [5]]
    broken = op("a", 3, partition=4)
    broken.spans[0].counts[:] = [0]
    assert not part_cork.layout_ok(broken)
    assert part_cork.corks([op("a", 1), broken, op("a", 1, partition=5)], 40) == [[0, 2], [1]]


def test_merge_keeps_batches_as_they_came_and_widens_the_spans() -> None:
    a = command_pb2.AppendOp.FromString(part(7, "a", [0, 1], [[2, 1], [1, 0]]))
    b = command_pb2.AppendOp.FromString(part(7, "b", [3], [[3]]))
    out = command_pb2.AppendOp()
    ranges = part_cork.merge([a, b], out)
    assert ranges == [range(0, 2), range(2, 3)]
    assert [p.partition for p in out.parts] == [0, 1, 3]
    assert [list(s.counts) for s in out.spans] == [[2, 1, 0], [1, 0, 0], [0, 0, 3]]
    assert [p.batch for p in out.parts] == [*(p.batch for p in a.parts), b.parts[0].batch]
    assert part_cork.layout_ok(out) and out.topic_id == 7
