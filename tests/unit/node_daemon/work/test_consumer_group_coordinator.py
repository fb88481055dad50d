"""The leader's side of consumer groups: revoking partitions that a member
holds past its session timeout are taken back through the log."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from node_daemon.replica.replica import NotLeader
from node_daemon.state.responses import OpResult
from node_daemon.work.consumer_group_coordinator import ConsumerGroupCoordinator
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
    coord = ConsumerGroupCoordinator(node)  # type: ignore[arg-type]

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
    coord = ConsumerGroupCoordinator(node)  # type: ignore[arg-type]
    req = client_pb2.CommitOffsetsRequest(group="dash", member_id="a", generation=2)
    req.offsets.add(partition=0, offset=7)
    with pytest.raises(RoadlogError) as e:
        asyncio.run(coord._within_data_groups(req))
    assert e.value.code == Code.UNAVAILABLE


class _Lagging:
    """This node's replica of a data group, ``ends`` the partition's end it
    shows before and after a linearizable read of the group (``barrier``:
    what that read does: an index, or an error)."""

    group = 1
    is_leader = False

    def __init__(self, ends: tuple[int, int], barrier: Exception | None = None) -> None:
        self.ends, self.barrier, self.barriers = ends, barrier, 0

    def committed_index(self) -> int:
        return 5

    async def wait_applied(self, index: int, timeout: float | None = None) -> None:
        return None

    async def read_barrier(self) -> int:
        if self.barrier is not None:
            raise self.barrier
        self.barriers += 1
        return 9

    @property
    def sm(self) -> object:
        end = self.ends[min(self.barriers, 1)]
        d = topics_pb2.TopicDescription()
        d.partitions.add(partition=0, next_offset=end)
        d.partitions.add(partition=1, next_offset=end)
        return SimpleNamespace(describe=lambda name: d)


def _commit_against(data: object, offset: int) -> None:
    topic = topics_pb2.Topic(id=3, partition_groups=[1, 1])
    topic.spec.name, topic.spec.partitions = "munich", 2
    described = groups_pb2.GroupDescription(group=group([]))
    sm = SimpleNamespace(describe_group=lambda name: described, topic=lambda name: topic)
    coord = ConsumerGroupCoordinator(SimpleNamespace(sm=sm, raft_groups={1: data}))  # type: ignore[arg-type]
    req = client_pb2.CommitOffsetsRequest(group="dash", member_id="a", generation=2)
    req.offsets.add(partition=0, offset=offset)
    asyncio.run(coord._within_data_groups(req))


def test_a_commit_past_a_lagging_replicas_end_is_judged_on_a_linearizable_read() -> None:
    """A consumer commits what another node served it; this node's replica
    of the group may not have it yet. Past this replica's end, the group is
    read linearizably (ReadIndex) before the commit is refused: a valid one
    goes through, one past the group's end is refused, and one that cannot
    be judged now is UNAVAILABLE (tried again), never refused."""
    caught_up = _Lagging((5, 8))
    _commit_against(caught_up, 7)  # past 5 here, within the group's 8: taken
    assert caught_up.barriers == 1
    beyond = _Lagging((5, 8))
    with pytest.raises(RoadlogError) as e:
        _commit_against(beyond, 10)
    assert e.value.code == Code.INVALID_ARGUMENT and "past the end" in e.value.message
    within = _Lagging((5, 5))
    _commit_against(within, 5)  # within this replica's end: no read needed
    assert within.barriers == 0
    for failure in (NotLeader(0), RoadlogError(Code.UNAVAILABLE, "worker gone")):
        with pytest.raises(RoadlogError) as e:
            _commit_against(_Lagging((5, 8), barrier=failure), 7)
        assert e.value.code == Code.UNAVAILABLE
