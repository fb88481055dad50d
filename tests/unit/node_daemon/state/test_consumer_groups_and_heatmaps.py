"""Consumer groups and give-to-get in the state machine, on real LMDB."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from node_daemon.state.machine import append_op
from node_daemon.state.responses import OpResult
from roadlog.columnar import PingColumns
from roadlog.errors import Code, RoadlogError
from roadlog.geo import bbox_region
from roadlog.partitioning import split_by_partition
from roadlog.v1 import client_pb2, command_pb2, groups_pb2, heatmaps_pb2, topics_pb2
from tests.unit.node_daemon.state.applying import T0, Applying

pytestmark = pytest.mark.unit

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson
PARTS = 6


class Cluster(Applying):
    """One replica fed committed entries."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        spec = topics_pb2.TopicSpec(
            name="munich", region_geojson=REGION, partitions=PARTS, contribution_window_ms=60_000
        )
        self.ok(command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec)))

    def join(self, member: str, group: str = "dash") -> client_pb2.JoinGroupResponse:
        req = client_pb2.JoinGroupRequest(group=group, topic="munich", member_id=member)
        raw = self.ok(command_pb2.Op(join_group=command_pb2.JoinGroupOp(request=req)))
        return client_pb2.JoinGroupResponse.FromString(raw)

    def leave(self, *members: str) -> None:
        op = command_pb2.LeaveGroupOp(group="dash", member_ids=members, reason="expired")
        self.ok(command_pb2.Op(leave_group=op))

    def commit(
        self, member: str, gen: int, offsets: dict[int, int], release: list[int] | None = None
    ) -> OpResult:
        req = client_pb2.CommitOffsetsRequest(
            group="dash",
            member_id=member,
            generation=gen,
            offsets=[groups_pb2.CommittedOffset(partition=p, offset=o) for p, o in offsets.items()],
            release=release or [],
        )
        return self.apply(command_pb2.Op(commit_offsets=command_pb2.CommitOffsetsOp(request=req)))

    def revoking(self) -> dict[str, list[int]]:
        g = self.sm.describe_group("dash").group
        return {m.member_id: list(m.revoking) for m in g.members if m.revoking}

    def settle(self) -> dict[str, list[int]]:
        """Every member commits nothing new and releases what it must give up."""
        gen = self.sm.describe_group("dash").group.generation
        for member, parts in self.revoking().items():
            res = self.commit(member, gen, {}, release=parts)
            assert res.code == Code.OK, res.message
        assert self.revoking() == {}
        return self.assignment()

    def publish(self, client: str, at_ms: int, n: int = 3) -> None:
        cols = PingColumns.from_columns(
            [f"car-{i}" for i in range(n)], [at_ms] * n, [48.1] * n, [11.5] * n
        )
        self.ok(append_op("munich", split_by_partition(cols, PARTS), client_id=client), at_ms)

    def assignment(self) -> dict[str, list[int]]:
        g = self.sm.describe_group("dash").group
        return {m.member_id: list(m.partitions) for m in g.members}


@pytest.fixture
def c(tmp_path: Path) -> Iterator[Cluster]:
    cl = Cluster(tmp_path / "sm")
    yield cl
    cl.sm.close()


def assert_partitioned(assignment: dict[str, list[int]]) -> None:
    every = sorted(p for ps in assignment.values() for p in ps)
    assert every == list(range(PARTS)), assignment  # each partition exactly once


def test_members_share_the_partitions_and_every_change_bumps_the_generation(c: Cluster) -> None:
    a = c.join("a")
    assert a.generation == 1 and list(a.partitions) == list(range(PARTS))
    b = c.join("b")
    assert b.generation == 2
    assert_partitioned(c.assignment())
    assert len(c.settle()["a"]) == len(c.assignment()["b"]) == 3
    assert c.join("b").generation == 2  # a rejoin of a member changes nothing
    c.join("c")
    assert_partitioned(c.assignment())
    assert all(len(ps) == 2 for ps in c.settle().values())
    c.leave("b")
    assert set(c.assignment()) == {"a", "c"}
    assert_partitioned(c.assignment())
    assert c.sm.describe_group("dash").group.generation == 4


def test_commits_are_fenced_by_generation_and_ownership(c: Cluster) -> None:
    c.publish("x", T0, n=40)
    a = c.join("a")
    assert c.commit("a", a.generation, {0: 1}).code == Code.OK
    b = c.join("b")
    mine_b = c.settle()["b"]
    stale = c.commit("a", a.generation, {mine_b[0]: 1})
    assert stale.code == Code.FAILED_PRECONDITION and "stale generation" in stale.message
    not_owned = c.commit("a", b.generation, {mine_b[0]: 1})
    assert not_owned.code == Code.FAILED_PRECONDITION
    assert "not assigned" in not_owned.message
    gone = c.commit("zed", b.generation, {0: 1})
    assert gone.code == Code.FAILED_PRECONDITION and "join again" in gone.message
    end = c.sm.describe("munich").partitions[mine_b[0]].next_offset
    past = c.commit("b", b.generation, {mine_b[0]: end + 1})
    assert past.code == Code.INVALID_ARGUMENT
    assert c.commit("b", b.generation, {mine_b[0]: end}).code == Code.OK
    offsets = {o.partition: o.offset for o in c.sm.describe_group("dash").offsets}
    assert offsets == {0: 1, mine_b[0]: end}


def test_a_join_moves_a_partition_only_once_its_owner_commits_and_releases_it(
    c: Cluster,
) -> None:
    """Cooperative rebalance: the newcomer gets a partition only when its
    owner has stored its position and given it up, in one entry, so the
    newcomer starts exactly there and nothing is read twice."""
    c.publish("x", T0, n=40)
    a = c.join("a")
    b = c.join("b")
    assert c.assignment() == {"a": list(range(PARTS)), "b": []}  # nothing moved yet
    moving = c.revoking()["a"]
    assert len(moving) == PARTS // 2 and list(b.partitions) == []
    ends = {p.partition: p.next_offset for p in c.sm.describe("munich").partitions}
    # Still a's: it may commit them (in the new generation), and keeps the rest.
    done = {moving[0]: ends[moving[0]]}
    assert c.commit("a", b.generation, done, release=[moving[0]]).code == Code.OK
    after = c.assignment()
    assert moving[0] in after["b"] and moving[0] not in after["a"]
    assert c.revoking()["a"] == moving[1:]
    offsets = {o.partition: o.offset for o in c.sm.describe_group("dash").offsets}
    assert offsets[moving[0]] == ends[moving[0]]  # where b starts
    # Releasing a partition that is not revoking keeps it.
    kept = [p for p in after["a"] if p not in moving]
    assert c.commit("a", b.generation, {}, release=kept[:1]).code == Code.OK
    assert kept[0] in c.assignment()["a"]
    assert a.generation < b.generation
    assert_partitioned(c.settle())


def test_a_partition_held_too_long_is_taken_back_and_a_leaver_frees_its_own_at_once(
    c: Cluster,
) -> None:
    c.join("a")
    c.join("b")
    held = c.revoking()["a"]
    op = command_pb2.ReleasePartitionsOp(group="dash", member_id="a", partitions=held)
    c.ok(command_pb2.Op(release_partitions=op))
    assert c.revoking() == {} and c.assignment()["b"] == held
    c.ok(command_pb2.Op(release_partitions=op))  # again: a no longer has them, no change
    assert c.assignment()["b"] == held
    c.join("c")
    gone = c.assignment()["a"]
    assert c.revoking()["a"]  # part of them were about to move
    c.leave("a")  # a's partitions, revoking or not, go to their targets at once
    assert_partitioned(c.assignment())
    assert "a" not in c.assignment()
    settled = {
        p for m, ps in c.assignment().items() for p in ps if p not in c.revoking().get(m, [])
    }
    assert set(gone) <= settled


def test_bad_group_requests_change_nothing(c: Cluster) -> None:
    c.join("a")
    before = c.sm.digest()
    for req in (
        client_pb2.JoinGroupRequest(group="bad name!", topic="munich", member_id="m"),
        client_pb2.JoinGroupRequest(group="dash", topic="nowhere", member_id="m"),
        client_pb2.JoinGroupRequest(group="dash", topic="munich", member_id=""),
        client_pb2.JoinGroupRequest(
            group="dash", topic="munich", member_id="m", session_timeout_ms=5
        ),
    ):
        res = c.apply(command_pb2.Op(join_group=command_pb2.JoinGroupOp(request=req)))
        assert res.code != Code.OK
    with c.sm.env.begin() as txn:  # everything but the applied index is as it was
        assert c.sm.consumer_groups.describe(txn, "dash").group.generation == 1
    assert before != c.sm.digest()  # the applied index moved on ...
    assert c.assignment() == {"a": list(range(PARTS))}  # ... nothing else


def test_give_to_get_checks_the_rule_before_the_map(c: Cluster) -> None:
    def get(client: str, now: int) -> client_pb2.GetHeatmapResponse:
        return c.sm.heatmap(client_pb2.GetHeatmapRequest(topic="munich", client_id=client), now)

    with pytest.raises(RoadlogError) as e:
        get("stranger", T0)
    assert e.value.code == Code.PERMISSION_DENIED and "publish" in e.value.message
    c.publish("alice", T0 - 60_000, n=10)
    c.publish("alice", T0, n=10)  # stamped on the log's clock, already at T0: over 0 s
    with pytest.raises(RoadlogError) as e:  # not enough yet (20 pings over 60 s)
        get("alice", T0 + 1000)
    assert e.value.code == Code.PERMISSION_DENIED and "over 0 s" in e.value.message
    c.publish("alice", T0 + 60_000, n=1)  # 21 pings over 60 s: a contribution
    with pytest.raises(RoadlogError) as e:  # allowed, but no map yet
        get("alice", T0 + 61_000)
    assert e.value.code == Code.NOT_FOUND
    cells = heatmaps_pb2.HeatMapCells(
        h3=[617700169958293503], pings=[3], devices=[3], mean_speed_mps=[7.5]
    )
    for start in (T0, T0 + 300_000):
        hm = heatmaps_pb2.HeatMap(
            topic="munich",
            window_start_ms=start,
            window_end_ms=start + 300_000,
            h3_resolution=9,
            cells=cells,
        )
        c.ok(
            command_pb2.Op(
                put_heatmap=command_pb2.PutHeatmapOp(
                    request=client_pb2.PutHeatmapRequest(heatmap=hm)
                )
            )
        )
    got = get("alice", T0 + 90_000)
    assert got.heatmap.window_start_ms == T0 + 300_000 and list(got.windows) == [T0, T0 + 300_000]
    assert got.contributed_ms == T0 + 60_000 and list(got.heatmap.cells.pings) == [3]
    for who, now in (("stranger", T0), ("alice", T0 + 121_000), ("", T0)):
        with pytest.raises(RoadlogError) as e:  # a stranger, a lapsed contributor, no id
            get(who, now)
        assert e.value.code == Code.PERMISSION_DENIED


def test_a_malformed_heat_map_is_refused(c: Cluster) -> None:
    hm = heatmaps_pb2.HeatMap(
        topic="munich",
        window_start_ms=T0,
        window_end_ms=T0,
        cells=heatmaps_pb2.HeatMapCells(h3=[1, 2], pings=[1]),
    )
    res = c.apply(
        command_pb2.Op(
            put_heatmap=command_pb2.PutHeatmapOp(request=client_pb2.PutHeatmapRequest(heatmap=hm))
        )
    )
    assert res.code == Code.INVALID_ARGUMENT
    hm.window_end_ms = T0 + 1
    res = c.apply(
        command_pb2.Op(
            put_heatmap=command_pb2.PutHeatmapOp(request=client_pb2.PutHeatmapRequest(heatmap=hm))
        )
    )
    assert res.code == Code.INVALID_ARGUMENT and "length" in res.message


def test_deleting_a_topic_forgets_its_groups_and_maps(c: Cluster) -> None:
    c.join("a")
    c.publish("alice", T0)
    c.ok(command_pb2.Op(delete_topic=command_pb2.DeleteTopicOp(name="munich")))
    assert c.sm.list_groups() == []
    with c.sm.env.begin() as txn:
        assert list(txn.cursor(db=c.sm.heat.contrib)) == []


def test_a_group_is_deleted_with_its_offsets_once_no_member_is_in_it(c: Cluster) -> None:
    """Issue 19's bounds: consumer groups were never deleted."""

    def delete(group: str = "dash") -> OpResult:
        return c.apply(command_pb2.Op(delete_group=command_pb2.DeleteGroupOp(group=group)))

    c.publish("phone", T0, n=8)
    gen = c.join("m1").generation
    assert c.commit("m1", gen, {0: 1}).code == Code.OK
    busy = delete()
    assert busy.code == Code.FAILED_PRECONDITION and "1 members" in busy.message
    assert c.sm.describe_group("dash").offsets  # nothing was touched
    c.leave("m1")
    res = delete()
    assert res.code == Code.OK
    assert client_pb2.DeleteGroupResponse.FromString(res.response).applied_index == c.index
    with pytest.raises(RoadlogError) as e:
        c.sm.describe_group("dash")
    assert e.value.code == Code.NOT_FOUND
    assert delete().code == Code.NOT_FOUND
    c.join("m2")  # the name can be used again, from no offsets
    assert not c.sm.describe_group("dash").offsets
