"""A consumer group is its topic's (issue 39, finding 5): through the
leader's WorkHandler on a real state machine, an identity with
``read:berlin`` (the scopes its work item carries) describes, lists,
heartbeats, commits and leaves only berlin's groups; a munich group is
answered exactly as a group that does not exist (NOT_FOUND, the same
words), even where the caller names a real member, and a join that collides
with its name does not say its topic. Admins, ``read:*`` and calls without
an identity (client_auth none) see every group; an item with an identity and
no scopes (a queue server from before scopes travelled) sees none."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from node_daemon.state.machine import StateMachine
from node_daemon.state.responses import OpResult
from node_daemon.work.handler import WorkHandler
from roadlog.v1 import client_pb2, command_pb2, groups_pb2, work_pb2
from tests.unit.node_daemon.state.test_heatmap_retention import HOUR, T0, create_op, entry

pytestmark = pytest.mark.unit

OK = 0
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
BERLIN_READER = ("eve", ("read:berlin",))


class Leader:
    """Enough of a group 0 leader for the WorkHandler: its state, and
    proposals applied at once."""

    is_leader = True

    def __init__(self, path: Path) -> None:
        self.sm = StateMachine(path, map_size=64 << 20)
        self.index = 0
        self.apply(create_op("munich", retention_ms=HOUR), create_op("berlin", retention_ms=HOUR))

    def apply(self, *ops: command_pb2.Op) -> list[OpResult]:
        self.index += 1
        [results] = self.sm.apply([entry(self.index, T0, *ops)])
        return results

    async def propose_op(self, op: command_pb2.Op, deadline: float | None = None) -> OpResult:
        [res] = self.apply(op)
        return res


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[Leader]:
    node = Leader(tmp_path / "sm")
    yield node
    node.sm.close()


def call(
    leader: Leader, method: str, req: object, who: tuple[str, tuple[str, ...]] = BERLIN_READER
) -> work_pb2.WorkResult:
    principal, scopes = who
    item = work_pb2.WorkItem(
        id=1,
        method=method,
        request=req.SerializeToString(),  # type: ignore[attr-defined]
        principal=principal,
        scopes=scopes,
    )
    return asyncio.run(WorkHandler(leader).run(item))  # type: ignore[arg-type]


def join(leader: Leader, group: str, topic: str, who: str) -> client_pb2.JoinGroupResponse:
    req = client_pb2.JoinGroupRequest(group=group, topic=topic, session_timeout_ms=60_000)
    res = call(leader, "JoinGroup", req, (who, (f"read:{topic}",)))
    assert res.code == OK, res.message
    return client_pb2.JoinGroupResponse.FromString(res.response)


@pytest.fixture
def groups(leader: Leader) -> tuple[client_pb2.JoinGroupResponse, client_pb2.JoinGroupResponse]:
    """A munich reader's group "trucks" and the berlin reader's "vans"."""
    return join(leader, "trucks", "munich", "mo"), join(leader, "vans", "berlin", "eve")


def names(res: work_pb2.WorkResult) -> list[str]:
    assert res.code == OK, res.message
    return [d.group.name for d in client_pb2.ListGroupsResponse.FromString(res.response).groups]


def test_a_reader_lists_and_describes_only_its_topics_groups(
    leader: Leader, groups: tuple[client_pb2.JoinGroupResponse, ...]
) -> None:
    assert names(call(leader, "ListGroups", client_pb2.ListGroupsRequest())) == ["vans"]
    mine = call(leader, "DescribeGroup", client_pb2.DescribeGroupRequest(group="vans"))
    assert mine.code == OK
    assert groups_pb2.GroupDescription.FromString(mine.response).group.topic == "berlin"
    hidden = call(leader, "DescribeGroup", client_pb2.DescribeGroupRequest(group="trucks"))
    absent = call(leader, "DescribeGroup", client_pb2.DescribeGroupRequest(group="nosuch"))
    assert hidden.code == absent.code == NOT_FOUND
    assert hidden.message.replace("trucks", "G") == absent.message.replace("nosuch", "G")
    assert not hidden.response and "munich" not in hidden.message


@pytest.mark.parametrize(
    "who",
    [
        pytest.param(("root", ("admin",)), id="admin"),
        pytest.param(("spark", ("read:*",)), id="read-any"),
        pytest.param(("mo", ("read:munich", "read:berlin")), id="both-topics"),
        pytest.param(("", ()), id="no-identity"),  # client_auth none
    ],
)
def test_who_may_read_every_topic_sees_every_group(
    leader: Leader, groups: tuple[client_pb2.JoinGroupResponse, ...], who: tuple[str, tuple[str]]
) -> None:
    assert names(call(leader, "ListGroups", client_pb2.ListGroupsRequest(), who)) == [
        "trucks",
        "vans",
    ]
    req = client_pb2.DescribeGroupRequest(group="trucks")
    assert call(leader, "DescribeGroup", req, who).code == OK


def test_an_identity_without_scopes_on_its_item_sees_no_group(
    leader: Leader, groups: tuple[client_pb2.JoinGroupResponse, ...]
) -> None:
    """A queue server from before WorkItem.scopes sends the principal
    alone: the node fails closed."""
    old = ("eve", ())
    assert names(call(leader, "ListGroups", client_pb2.ListGroupsRequest(), old)) == []
    req = client_pb2.DescribeGroupRequest(group="vans")
    assert call(leader, "DescribeGroup", req, old).code == NOT_FOUND


def test_member_calls_on_another_topics_group_look_like_no_group(
    leader: Leader, groups: tuple[client_pb2.JoinGroupResponse, ...]
) -> None:
    """Even naming the real member of munich's group, the berlin reader
    learns nothing (before: "belongs to another client", which told the
    group and the member exist); the member itself is untouched."""
    trucks, _ = groups
    member, gen = trucks.member_id, trucks.generation
    for group in ("trucks", "nosuch"):
        answers = [
            call(leader, "Heartbeat", client_pb2.HeartbeatRequest(
                group=group, member_id=member, generation=gen)),
            call(leader, "CommitOffsets", client_pb2.CommitOffsetsRequest(
                group=group, member_id=member, generation=gen,
                offsets=[groups_pb2.CommittedOffset(partition=p, offset=0)
                         for p in trucks.partitions])),
            call(leader, "LeaveGroup", client_pb2.LeaveGroupRequest(
                group=group, member_id=member)),
        ]  # fmt: skip
        assert [a.code for a in answers] == [NOT_FOUND] * 3, [a.message for a in answers]
        assert all(a.message == f"no group {group!r}" for a in answers), answers
    d = leader.sm.describe_group("trucks")
    assert [m.member_id for m in d.group.members] == [member] and not d.offsets
    # Its own identity still heartbeats, commits and leaves.
    mo = ("mo", ("read:munich",))
    beat = client_pb2.HeartbeatRequest(group="trucks", member_id=member, generation=gen)
    assert call(leader, "Heartbeat", beat, mo).code == OK
    leave = client_pb2.LeaveGroupRequest(group="trucks", member_id=member)
    assert call(leader, "LeaveGroup", leave, mo).code == OK


def test_a_join_that_collides_with_another_topics_group_does_not_name_it(
    leader: Leader, groups: tuple[client_pb2.JoinGroupResponse, ...]
) -> None:
    trucks, _ = groups
    for member in ("", trucks.member_id):  # a new member, and munich's member's id
        req = client_pb2.JoinGroupRequest(group="trucks", topic="berlin", member_id=member)
        res = call(leader, "JoinGroup", req)
        assert res.code == FAILED_PRECONDITION, res.message
        assert "munich" not in res.message and "choose another" in res.message
    assert len(leader.sm.describe_group("trucks").group.members) == 1
