"""The leader's side of consumer groups: revoking partitions that a member
holds past its session timeout are taken back through the log."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from node_daemon.group_coordinator import GroupCoordinator
from node_daemon.state.machine import OpResult
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, command_pb2, groups_pb2, topics_pb2

pytestmark = pytest.mark.unit


class ProposalLog:
    """A leader that records what it is asked to propose."""

    def __init__(self) -> None:
        self.ops: list[command_pb2.Op] = []

    async def propose_op(self, op: command_pb2.Op, deadline: float | None = None) -> OpResult:
        self.ops.append(op)
        return OpResult()


def group(revoking: list[int]) -> groups_pb2.Group:
    g = groups_pb2.Group(name="dash", topic="munich", generation=2, session_timeout_ms=3000)
    g.members.add(member_id="a", partitions=[0, 1, 2], revoking=revoking)
    g.members.add(member_id="b", partitions=[])
    return g


def test_revoking_partitions_held_past_the_session_timeout_are_taken_back() -> None:
    node = ProposalLog()
    coord = GroupCoordinator(node)  # type: ignore[arg-type]

    def at(now: float, revoking: list[int]) -> list[command_pb2.Op]:
        before = len(node.ops)
        asyncio.run(coord._take_held_partitions(group(revoking), now, 3.0))
        return node.ops[before:]

    assert at(100.0, [1, 2]) == []  # first seen: the grace starts
    assert at(102.9, [1, 2]) == []
    assert at(103.0, [2]) == []  # a new set to give up (it released 1): a new grace
    assert at(105.9, [2]) == []
    [op] = at(106.1, [2])
    rel = op.release_partitions
    assert (rel.group, rel.member_id, list(rel.partitions)) == ("dash", "a", [2])
    assert at(106.2, []) == [] and coord.revoking_since == {}  # released: forgotten


class _Unreadable:
    """A data group's replica another process runs, not readable for now
    (its snapshot being installed, its process starting)."""

    group = 1
    is_leader = False

    def committed_index(self) -> int:
        return 5

    async def wait_applied(self, index: int, timeout: float | None = None) -> None:
        return None

    @property
    def sm(self) -> object:
        raise RoadlogError(Code.UNAVAILABLE, "group 1's replica on this node is rebuilding")


def test_a_commit_checked_against_an_unreadable_replica_is_unavailable_not_refused() -> None:
    """Offsets of a topic in data groups are checked against this node's
    replica of each group; one that cannot be read now makes the commit
    UNAVAILABLE (tried again), never INVALID_ARGUMENT as if past the end."""
    topic = topics_pb2.Topic(id=3, partition_groups=[1, 1])
    topic.spec.name, topic.spec.partitions = "munich", 2
    described = groups_pb2.GroupDescription(group=group([]))
    sm = SimpleNamespace(describe_group=lambda name: described, topic=lambda name: topic)
    node = SimpleNamespace(sm=sm, raft_groups={1: _Unreadable()})
    coord = GroupCoordinator(node)  # type: ignore[arg-type]
    req = client_pb2.CommitOffsetsRequest(group="dash", member_id="a", generation=2)
    req.offsets.add(partition=0, offset=7)
    with pytest.raises(RoadlogError) as e:
        asyncio.run(coord._within_data_groups(req))
    assert e.value.code == Code.UNAVAILABLE
