"""Consumer-group quotas and expiry (issue 19, finding 10), on real LMDB.

A join that would pass a quota its op carries is refused with
RESOURCE_EXHAUSTED where it is applied, on every replica alike, and by the
leader before proposing; other identities are not affected; a group
deleted, expired or dropped with its topic frees its owner's quota, a
member that left frees its identity's. The retention trim deletes only
groups with no member whose last commit and emptying are older than the
retention, on the log's clock. Replicas fed the same entries stay
identical, entries from before quotas included."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from node_daemon.state import consumer_groups
from node_daemon.state.consumer_groups import GROUP_RETENTION_MS
from node_daemon.state.machine import StateMachine, trim_op
from node_daemon.state.responses import OpResult
from node_daemon.work.handler import WorkHandler
from roadlog.errors import Code
from roadlog.v1 import client_pb2, command_pb2, work_pb2
from tests.unit.node_daemon.state.test_heatmap_retention import HOUR, T0, create_op, entry

pytestmark = pytest.mark.unit

DAY = 24 * HOUR


def quotas(
    groups: int = 100, members: int = 100, per_client: int = 2, members_per_client: int = 3
) -> command_pb2.GroupQuotas:
    return command_pb2.GroupQuotas(
        groups=groups,
        members=members,
        groups_per_client=per_client,
        members_per_client=members_per_client,
    )


class Replica:
    def __init__(self, path: Path) -> None:
        self.sm = StateMachine(path, map_size=64 << 20)
        self.index = 0
        self.quotas: command_pb2.GroupQuotas | None = quotas()
        self.run(T0, create_op("munich", retention_ms=DAY))

    def run(self, leader_ms: int, *ops: command_pb2.Op) -> list[OpResult]:
        self.index += 1
        [results] = self.sm.apply([entry(self.index, leader_ms, *ops)])
        return results

    def join_op(self, client: str, group: str, member: str) -> command_pb2.Op:
        req = client_pb2.JoinGroupRequest(
            group=group, topic="munich", member_id=member, client_id=client
        )
        op = command_pb2.JoinGroupOp(request=req)
        if self.quotas is not None:  # None: an entry from before quotas
            op.bound = bool(client)
            op.quotas.CopyFrom(self.quotas)
        return command_pb2.Op(join_group=op)

    def join(self, client: str, group: str, member: str, at_ms: int = T0) -> OpResult:
        [res] = self.run(at_ms, self.join_op(client, group, member))
        return res

    def leave(self, group: str, *members: str, at_ms: int = T0) -> None:
        op = command_pb2.LeaveGroupOp(group=group, member_ids=members, reason="left")
        [res] = self.run(at_ms, command_pb2.Op(leave_group=op))
        assert res.code == Code.OK, res.message

    def commit(self, group: str, member: str, at_ms: int) -> None:
        """Commit offset 0 of every partition the member owns."""
        g = self.sm.describe_group(group).group
        me = next(m for m in g.members if m.member_id == member)
        req = client_pb2.CommitOffsetsRequest(
            group=group, member_id=member, generation=g.generation
        )
        for p in me.partitions:
            req.offsets.add(partition=p, offset=0)
        op = command_pb2.Op(commit_offsets=command_pb2.CommitOffsetsOp(request=req))
        [res] = self.run(at_ms, op)
        assert res.code == Code.OK, res.message

    def delete(self, group: str) -> Code:
        op = command_pb2.Op(delete_group=command_pb2.DeleteGroupOp(group=group))
        [res] = self.run(T0, op)
        return res.code

    def names(self) -> list[str]:
        return [d.group.name for d in self.sm.list_groups()]

    def held(self, client: str) -> tuple[int, int]:
        """(groups owned, members) of ``client``, as the quotas count them."""
        with self.sm.env.begin() as txn:
            return self.sm.consumer_groups.owned(txn, client), self.sm.consumer_groups.joined(
                txn, client
            )

    def members(self) -> int:
        with self.sm.env.begin() as txn:
            return self.sm.consumer_groups.member_count(txn)


@pytest.fixture
def r(tmp_path: Path) -> Iterator[Replica]:
    rep = Replica(tmp_path / "sm")
    yield rep
    rep.sm.close()


def test_an_identity_at_its_group_quota_is_refused_and_others_are_not(r: Replica) -> None:
    assert r.join("alice", "a1", "m1").code == Code.OK
    assert r.join("alice", "a2", "m2").code == Code.OK
    refused = r.join("alice", "a3", "m3")
    assert refused.code == Code.RESOURCE_EXHAUSTED
    assert "created 2 consumer groups" in refused.message and "leave" in refused.message
    assert "a3" not in r.names() and r.held("alice") == (2, 2)
    # Another identity creates groups; alice may still join existing ones
    # (a group is charged to whoever created it, once).
    assert r.join("bob", "b1", "m4").code == Code.OK
    assert r.join("alice", "b1", "m5").code == Code.OK
    assert r.held("alice") == (2, 3) and r.held("bob") == (1, 1)
    # A join without an identity (client_auth none) is charged to nobody.
    assert r.join("", "anon", "m6").code == Code.OK
    assert r.sm.describe_group("anon").group.owner == ""
    assert r.sm.describe_group("a1").group.owner == "alice"


def test_joins_proposed_side_by_side_are_held_to_the_quota_where_applied(r: Replica) -> None:
    """The leader's check sees only what is applied: joins it let through
    together (one entry here) are held to the quota by the apply."""
    ops = [r.join_op("alice", f"a{i}", f"m{i}") for i in range(4)]
    results = r.run(T0, *ops)
    assert [res.code for res in results] == [Code.OK] * 2 + [Code.RESOURCE_EXHAUSTED] * 2
    assert r.names() == ["a0", "a1"] and r.held("alice") == (2, 2)


def test_an_identity_cannot_pile_up_members_across_groups(r: Replica) -> None:
    assert r.join("bob", "b1", "m1").code == Code.OK
    assert r.join("bob", "b2", "m2").code == Code.OK
    for group, member in (("b1", "a1"), ("b2", "a2"), ("b2", "a3")):
        assert r.join("alice", group, member).code == Code.OK
    refused = r.join("alice", "b1", "a4")
    assert refused.code == Code.RESOURCE_EXHAUSTED and "3 members" in refused.message
    # A member joining again holds nothing new; bob is not affected.
    assert r.join("alice", "b1", "a1").code == Code.OK
    assert r.join("bob", "b1", "m3").code == Code.OK
    r.leave("b2", "a3")  # leaving frees the member's place
    assert r.held("alice") == (0, 2)
    assert r.join("alice", "b1", "a4").code == Code.OK


def test_the_cluster_caps_groups_and_members_whoever_asks(r: Replica) -> None:
    r.quotas = quotas(groups=2, members=4, per_client=10, members_per_client=10)
    assert r.join("alice", "a1", "m1").code == Code.OK
    assert r.join("", "anon", "m2").code == Code.OK
    refused = r.join("bob", "b1", "m3")
    assert refused.code == Code.RESOURCE_EXHAUSTED and "the cluster holds 2" in refused.message
    assert r.join("bob", "a1", "m3").code == Code.OK  # an existing group: no new group
    assert r.join("", "anon", "m4").code == Code.OK
    refused = r.join("carol", "a1", "m5")
    assert refused.code == Code.RESOURCE_EXHAUSTED and "4 members" in refused.message
    assert r.members() == 4 and r.names() == ["a1", "anon"]


def test_a_deleted_group_or_topic_frees_its_owners_quota(r: Replica) -> None:
    assert r.join("alice", "a1", "m1").code == Code.OK
    assert r.join("alice", "a2", "m2").code == Code.OK
    assert r.join("alice", "a3", "m3").code == Code.RESOURCE_EXHAUSTED
    r.leave("a1", "m1")
    assert r.held("alice") == (2, 1)  # an empty group is still hers until it goes
    assert r.delete("a1") == Code.OK
    assert r.held("alice") == (1, 1)
    assert r.join("alice", "a3", "m3").code == Code.OK
    assert r.members() == 2
    [res] = r.run(T0, command_pb2.Op(delete_topic=command_pb2.DeleteTopicOp(name="munich")))
    assert res.code == Code.OK
    assert r.held("alice") == (0, 0) and r.members() == 0 and r.names() == []


def test_only_groups_empty_and_idle_past_the_retention_expire(r: Replica) -> None:
    # "done": emptied at T0 after its last commit. "busy": a member is still
    # in it (its last commit at T0). "late": committed at T0, its member left
    # 6 days later: its retention runs from then (Kafka's KIP-211).
    for group in ("done", "busy", "late"):
        assert r.join("alice" if group != "late" else "bob", group, f"{group}-m").code == Code.OK
        r.commit(group, f"{group}-m", T0)
    r.leave("done", "done-m", at_ms=T0)
    r.leave("late", "late-m", at_ms=T0 + 6 * DAY)
    assert r.held("alice") == (2, 1)
    r.run(T0 + GROUP_RETENTION_MS - HOUR, trim_op())  # not old enough yet
    assert r.names() == ["busy", "done", "late"]
    after = T0 + GROUP_RETENTION_MS + HOUR
    r.run(after, trim_op(group_retention_ms=0))  # an entry from before group expiry
    assert r.names() == ["busy", "done", "late"]
    r.run(after, trim_op())
    assert r.names() == ["busy", "late"]
    assert r.held("alice") == (1, 1)  # the expired group no longer counts
    assert r.join("alice", "again", "m").code == Code.OK
    r.run(T0 + 6 * DAY + GROUP_RETENTION_MS + HOUR, trim_op())
    assert r.names() == ["again", "busy"]
    assert r.held("bob") == (0, 0)


def test_the_trim_measures_on_the_log_clock(r: Replica) -> None:
    """A trim whose leader's clock is behind the log's (a stepped wall
    clock) expires by the log's clock, never by the entry's own time."""
    assert r.join("alice", "g", "m").code == Code.OK
    r.leave("g", "m", at_ms=T0)
    later = T0 + GROUP_RETENTION_MS + HOUR
    assert r.join("bob", "keep", "k", at_ms=later).code == Code.OK  # moves the log's clock
    r.run(T0, trim_op())  # this leader's clock says T0
    assert r.names() == ["keep"]


def test_replicas_fed_the_same_entries_agree_with_entries_from_before_quotas(
    tmp_path: Path,
) -> None:
    a, b = Replica(tmp_path / "a"), Replica(tmp_path / "b")
    try:
        for rep in (a, b):
            rep.quotas = None  # entries from before quotas: nothing checked, nothing counted
            for i in range(3):
                assert rep.join("alice", f"old{i}", f"m{i}").code == Code.OK
            rep.quotas = quotas(members=5)
            # The old groups are charged to nobody; the cluster's members
            # are counted from the groups once the first new join comes.
            assert rep.held("alice") == (0, 0) and rep.members() == 3
            codes = [
                rep.join("alice", g, m).code
                for g, m in (("n1", "x1"), ("n2", "x2"), ("n3", "x3"), ("old0", "x4"))
            ]
            assert codes == [Code.OK, Code.OK] + [Code.RESOURCE_EXHAUSTED] * 2
            rep.leave("old1", "m1", at_ms=T0 + HOUR)
            assert rep.members() == 4
            rep.run(T0 + GROUP_RETENTION_MS + 2 * HOUR, trim_op())
            assert "old1" not in rep.names() and rep.members() == 4
        assert a.sm.digest() == b.sm.digest()
    finally:
        a.sm.close()
        b.sm.close()


def test_the_leader_refuses_a_join_past_a_quota_before_proposing(
    r: Replica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the WorkHandler: the identity at its quota is answered
    RESOURCE_EXHAUSTED and nothing is proposed; another identity joins."""
    monkeypatch.setattr(consumer_groups, "MAX_GROUPS_PER_CLIENT", 1)
    proposed: list[command_pb2.Op] = []

    class Leader:
        sm = r.sm

        async def propose_op(self, op: command_pb2.Op, deadline: float | None = None) -> OpResult:
            proposed.append(op)
            [res] = r.run(T0, op)
            return res

    async def join(principal: str, group: str) -> work_pb2.WorkResult:
        handler = WorkHandler(Leader())  # type: ignore[arg-type]
        req = client_pb2.JoinGroupRequest(group=group, topic="munich", client_id="declared")
        item = work_pb2.WorkItem(
            id=1, method="JoinGroup", request=req.SerializeToString(), principal=principal
        )
        return await handler.run(item)

    assert asyncio.run(join("alice", "g1")).code == 0
    refused = asyncio.run(join("alice", "g2"))
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "created 1 consumer groups" in refused.message
    assert asyncio.run(join("bob", "g2")).code == 0
    assert [(op.join_group.request.client_id, op.join_group.bound) for op in proposed] == [
        ("alice", True),
        ("bob", True),
    ]
    assert proposed[0].join_group.quotas.groups_per_client == 1
