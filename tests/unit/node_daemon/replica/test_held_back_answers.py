"""A node that lost its leadership while its writes fail for want of space
answers the proposals it still holds at once, as outcome unknown
(``held_back.answer_held_back``: DEADLINE_EXCEEDED, never handed to another
node): it applies nothing until it has room, and the callers would wait past
their deadlines for an entry the new leader applies. With room, or still
leading, it keeps them for its apply."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from node_daemon.raft import Role
from node_daemon.replica.held_back import answer_held_back
from node_daemon.replica.replica import Replica
from node_daemon.state.responses import OpResult
from roadlog.errors import Code, RoadlogError
from tests.unit.node_daemon.replica.test_follower_inline_io import _close
from tests.unit.node_daemon.replica.test_propose_future import _node

pytestmark = pytest.mark.unit


def _holding(node: Replica) -> asyncio.Future[OpResult]:
    """A proposal this node holds, as one in its log waiting to be applied."""
    fut: asyncio.Future[OpResult] = asyncio.get_running_loop().create_future()
    node._pending.add(node.core.log.last_index() + 1, node.core.term, [fut])
    return fut


@pytest.mark.parametrize(
    ("leads", "failing", "answered"),
    [(False, True, True), (False, False, False), (True, True, False)],
    ids=["follower-out-of-space", "follower-with-room", "leader-out-of-space"],
)
def test_held_back_proposals_are_answered_only_off_the_lead_and_out_of_space(
    tmp_path: Path, leads: bool, failing: bool, answered: bool
) -> None:
    async def main() -> None:
        node = _node(tmp_path, peers=1 if leads else 2)
        try:
            if leads:
                node.core.campaign()  # the only voter: leader at once
            assert (node.core.role == Role.LEADER) == leads
            fut = _holding(node)
            if failing:
                node.disk.write_failed()
            answer_held_back(node.is_leader, node.disk, node._pending, node.id, node.group)
            assert fut.done() == answered
            if answered:
                # Not NotLeader: the queue server would hand it to the new
                # leader, and a plain publish would be stored twice.
                with pytest.raises(RoadlogError, match="outcome unknown") as e:
                    fut.result()
                assert e.value.code == Code.DEADLINE_EXCEEDED
                assert len(node._pending) == 0
            else:
                assert len(node._pending) == 1
        finally:
            _close(node)

    asyncio.run(main())
