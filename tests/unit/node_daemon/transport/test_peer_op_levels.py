"""The operation kinds a node's release applies ride on every batch it
sends (``RaftBatch.op_level``, issue 39), over the framed link and the gRPC
stream alike, and the receiver keeps each peer's last word
(``peer_op_levels``), which group 0's leader reads before it proposes a
newer kind (``node_daemon.state.op_gate``); a peer of an older release
says nothing: 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.raft import Message
from node_daemon.transport.batch_wire import encode_batch
from roadlog.v1 import raft_pb2
from tests.unit.node_daemon.transport.test_peer_frames import _append, _serving, _transport
from tests.unit.support.loops import run_bounded, until

pytestmark = pytest.mark.unit


def test_a_batch_says_its_senders_level_and_an_older_one_says_nothing() -> None:
    batch = raft_pb2.RaftBatch.FromString(b"".join(encode_batch("c", 2, [], False, op_level=2)))
    assert batch.op_level == 2
    assert raft_pb2.RaftBatch.FromString(b"".join(encode_batch("c", 2, []))).op_level == 0
    assert raft_pb2.RaftBatch(cluster="c").op_level == 0


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "grpc-fallback"])
def test_the_receiver_keeps_what_each_peer_said_last(tmp_path: Path, frames: bool) -> None:
    async def body() -> None:
        got_b: list[Message] = []
        b = _transport(2, tmp_path, got_b)
        server, addr = await _serving(b, frames)
        a = _transport(1, tmp_path, [])
        a.set_addresses({2: addr})
        try:
            assert 1 not in b.peer_op_levels  # not heard from yet
            a.send([_append(1, 2, 1)])  # a transport nobody set: as an older release
            await until(lambda: len(got_b) == 1, "the first message")
            assert b.peer_op_levels[1] == 0
            a.op_level = 2  # what Store sets
            a.send([_append(1, 2, 2)])
            await until(lambda: b.peer_op_levels.get(1) == 2, "the level said")
            a.op_level = 1  # the node came back with an older release
            a.send([_append(1, 2, 3)])
            await until(lambda: b.peer_op_levels.get(1) == 1, "the older level said")
        finally:
            await a.close()
            await b.close()
            await server.stop(None)

    run_bounded(body)
