"""``Replica.propose_op`` hands back a future, not a coroutine: a refusal
(not the leader) is in the future, never raised at the call; a taken op's
future is the one its apply answers, so a callback hung on it runs with no
task between."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from node_daemon.config import NodeConfig
from node_daemon.replica.replica import NotLeader, Replica
from node_daemon.state.responses import OpResult
from roadlog.runtime.processes import free_port
from roadlog.v1 import command_pb2
from tests.unit.node_daemon.replica.test_follower_inline_io import _close

pytestmark = pytest.mark.unit


def _node(tmp_path: Path, peers: int) -> Replica:
    addrs = {i: f"127.0.0.1:{free_port()}" for i in range(1, peers + 1)}
    cfg = NodeConfig(node_id=1, data_dir=tmp_path / "n1", listen=addrs[1], peers=addrs)
    node = Replica(cfg)
    node._loop = asyncio.get_running_loop()
    return node


def test_a_follower_refuses_in_the_future_not_at_the_call(tmp_path: Path) -> None:
    async def main() -> None:
        node = _node(tmp_path, peers=2)
        try:
            assert not node.is_leader
            fut = node.propose_op(command_pb2.Op())  # does not raise here
            assert isinstance(fut, asyncio.Future)
            assert fut.done()
            with pytest.raises(NotLeader):
                await fut
            assert not node._ops  # nothing was queued for the log
        finally:
            _close(node)

    asyncio.run(main())


def test_a_leader_queues_the_op_and_its_apply_answers_the_same_future(tmp_path: Path) -> None:
    async def main() -> None:
        node = _node(tmp_path, peers=1)
        try:
            node.core.campaign()  # the only voter: leader at once
            assert node.is_leader
            seen: list[OpResult] = []
            fut = node.propose_op(command_pb2.Op())
            fut.add_done_callback(lambda f: seen.append(f.result()))
            assert not fut.done()
            [(_, queued, _)] = node._ops
            assert queued is fut  # the driver's future, not a wrapper's
            answer = OpResult(response=b"applied")
            queued.set_result(answer)
            await asyncio.sleep(0)  # the callback's turn
            assert seen == [answer]
        finally:
            _close(node)

    asyncio.run(main())
