"""A leader answers publishes without idempotent producers as their entry
commits, and stores them a few turns of the event loop later: the answer
comes while the state has not applied the entry yet, a read fenced at the
answer's index waits for the store and then sees every ping, and the next
proposals go on as before. An idempotent producer's publish (whose answer
depends on what is stored) is answered after its apply, as before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from node_daemon.config import NodeConfig
from node_daemon.raft import Entry
from node_daemon.replica.replica import Replica
from node_daemon.state.machine import append_op
from node_daemon.state.responses import OpResult
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.geo import bbox_region
from roadlog.runtime.processes import free_port
from roadlog.v1 import client_pb2, command_pb2, topics_pb2

pytestmark = pytest.mark.unit

REGION = bbox_region(11.4, 48.05, 11.75, 48.25)
T0 = 1_800_000_000_000


def _pings(n: int, first: int) -> PingColumns:
    return PingColumns.from_columns(
        [f"car-{i % 3}" for i in range(n)],
        np.arange(T0 + first, T0 + first + n),
        np.full(n, 48.1),
        np.full(n, 11.5),
    )


async def _leader(tmp_path: Path) -> Replica:
    addr = f"127.0.0.1:{free_port()}"
    cfg = NodeConfig(node_id=1, data_dir=tmp_path / "n1", listen=addr, peers={1: addr})
    node = Replica(cfg)
    await node.start()
    node.submit(lambda core: core.campaign())  # the only voter
    deadline = asyncio.get_running_loop().time() + 10
    while not node.is_leader:
        assert asyncio.get_running_loop().time() < deadline, "no leader"
        await asyncio.sleep(0.01)
    spec = topics_pb2.TopicSpec(name="munich", region_geojson=REGION.geojson, partitions=2)
    made = await node.propose_op(command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec)))
    assert made.code == 0, made.message
    return node


async def _publish(node: Replica, op: command_pb2.Op) -> tuple[OpResult, int]:
    """The op's result, and the state's applied index when it came."""
    fut = node.propose_op(op)
    seen: list[int] = []
    fut.add_done_callback(lambda _: seen.append(node.sm.applied_index))
    res = await fut
    return res, seen[0]


def _fence(res: OpResult) -> int:
    [span] = res.spans
    assert span.code == 0, span.message
    return client_pb2.PublishResponse.FromString(span.response).applied_index


def _stored(node: Replica, partition: int) -> list[int]:
    resp = node.sm.fetch(client_pb2.FetchRequest(topic="munich", partition=partition))
    out: list[int] = []
    for b in resp.batches:
        out += (columnar.decode(b.batch).ts_ms - T0).tolist()
    return out


def test_plain_publishes_are_answered_at_commit_and_stored_right_after(tmp_path: Path) -> None:
    async def main() -> None:
        node = await _leader(tmp_path)
        try:
            sent: list[int] = []
            for k in range(6):
                op = append_op("munich", [(k % 2, _pings(10, 10 * k))], client_id="c")
                res, applied_then = await _publish(node, op)
                index = _fence(res)
                if k >= 2:
                    # Answered before its entry was stored here (the first
                    # append to each partition after the topic was made
                    # reads its state from LMDB: answered after its apply).
                    assert applied_then < index
                await node.wait_applied(index, timeout=10)
                sent += range(10 * k, 10 * k + 10)
                assert sorted(_stored(node, 0) + _stored(node, 1)) == sent
            offsets = client_pb2.PublishResponse.FromString(res.spans[0].response).offsets
            assert [(o.partition, o.base_offset, o.count) for o in offsets] == [(1, 20, 10)]
        finally:
            await node.stop()

    asyncio.run(main())


def test_answers_told_ahead_are_dropped_once_the_state_moved(tmp_path: Path) -> None:
    """Answers told for entries being written are sent only for those very
    entries (index and term) and only while the state is the one they were
    told from: an apply or a forgetting in between drops them."""

    async def main() -> None:
        node = await _leader(tmp_path)
        try:
            for k in range(2):  # each partition's state remembered
                res, _ = await _publish(node, append_op("munich", [(k, _pings(3, 3 * k))]))
                await node.wait_applied(_fence(res), timeout=10)
            nxt = node.sm.applied_index + 1
            op = command_pb2.Command(ops=[append_op("munich", [(0, _pings(2, 50))])])
            entries = [Entry(node.core.term, nxt, data=op.SerializeToString())]
            node._predict(entries)
            known, told = node._told_for(entries)
            # What apply would answer: the next offsets of partition 0.
            assert known and told is not None and told == node.sm.answers(entries)
            [[res]] = told
            assert _fence(res) == nxt
            offsets = client_pb2.PublishResponse.FromString(res.spans[0].response).offsets
            assert [(o.partition, o.base_offset, o.count) for o in offsets] == [(0, 3, 2)]
            node._predict(entries)
            other = [Entry(node.core.term + 1, nxt, data=entries[0].data)]
            assert node._told_for(other) == (False, None)  # another entry at that index
            node._predict(entries)
            node.sm._forget()
            assert node._told_for(entries) == (False, None)
            node._predict([Entry(node.core.term, nxt + 1, data=entries[0].data)])
            assert node._predicted is None  # an entry before it is not applied
            # An idempotent producer's append: told that only its apply can
            # tell, so the commit does not work it out a second time.
            dup = command_pb2.Command(
                ops=[append_op("munich", [(0, _pings(2, 60))], producer_id=7, sequence=1)]
            )
            node._predict([Entry(node.core.term, nxt, data=dup.SerializeToString())])
            assert node._told_for([Entry(node.core.term, nxt, data=dup.SerializeToString())]) == (
                True,
                None,
            )
        finally:
            await node.stop()

    asyncio.run(main())


def test_an_idempotent_producers_publish_is_answered_after_it_is_stored(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        node = await _leader(tmp_path)
        try:
            issue = command_pb2.Op(
                init_producer=command_pb2.InitProducerOp(client_id="c", producer_id=7)
            )
            assert (await node.propose_op(issue)).code == 0
            op = append_op("munich", [(1, _pings(4, 0))], producer_id=7, sequence=1, client_id="c")
            res, applied_then = await _publish(node, op)
            assert applied_then >= _fence(res)  # stored when answered
            again, _ = await _publish(node, op)  # a retry: its original offsets
            first = client_pb2.PublishResponse.FromString(res.spans[0].response)
            retry = client_pb2.PublishResponse.FromString(again.spans[0].response)
            assert list(retry.offsets) == list(first.offsets)
            assert _stored(node, 1) == [0, 1, 2, 3]
        finally:
            await node.stop()

    asyncio.run(main())
