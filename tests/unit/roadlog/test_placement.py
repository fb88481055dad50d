"""Which Raft group holds each partition (issue 18's data model): the map
made when a topic is created, the cluster's number of data groups fixed by
its first topic, what describe and ``cluster status`` report, and the node
refusing more than one data group until several run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from node_daemon.config import NodeConfig
from node_daemon.raft import Entry, EntryType
from node_daemon.state.machine import StateMachine
from roadlog.cli.cluster import raft_groups
from roadlog.errors import Code
from roadlog.geo import bbox_region
from roadlog.placement import group_of, partition_groups
from roadlog.runtime.config import ConfigError
from roadlog.v1 import command_pb2, topics_pb2

pytestmark = pytest.mark.unit

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson


def test_one_data_group_keeps_every_partition_in_group_0() -> None:
    assert partition_groups(7, 8, 1) == []
    assert group_of(topics_pb2.Topic(id=7), 5) == 0


def test_partitions_go_round_the_data_groups_each_topic_starting_further() -> None:
    assert partition_groups(1, 5, 3) == [2, 3, 1, 2, 3]
    assert partition_groups(2, 5, 3) == [3, 1, 2, 3, 1]
    # topics with fewer partitions than groups still spread over them
    firsts = {partition_groups(t, 1, 4)[0] for t in range(1, 9)}
    assert firsts == {1, 2, 3, 4}
    topic = topics_pb2.Topic(id=1, partition_groups=partition_groups(1, 5, 3))
    assert [group_of(topic, p) for p in range(5)] == [2, 3, 1, 2, 3]


@pytest.mark.parametrize("groups", [0, -1, 65])
def test_a_number_of_groups_out_of_range_is_refused(groups: int) -> None:
    with pytest.raises(ValueError, match="data_groups"):
        partition_groups(1, 4, groups)


@pytest.fixture
def sm(tmp_path: Path) -> Iterator[StateMachine]:
    s = StateMachine(tmp_path / "sm", map_size=64 << 20)
    yield s
    s.close()


def create(sm: StateMachine, name: str, partitions: int, data_groups: int) -> topics_pb2.Topic:
    spec = topics_pb2.TopicSpec(name=name, region_geojson=REGION, partitions=partitions)
    op = command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec, data_groups=data_groups))
    cmd = command_pb2.Command(leader_ms=1_700_000_000_000, ops=[op])
    [[res]] = sm.apply([Entry(1, sm.applied_index + 1, EntryType.NORMAL, cmd.SerializeToString())])
    assert res.code == Code.OK, res.message
    d = topics_pb2.TopicDescription.FromString(res.response)
    assert [p.group for p in d.partitions] == [group_of(d.topic, p) for p in range(partitions)]
    return d.topic


def test_the_first_topic_fixes_the_clusters_data_groups(sm: StateMachine) -> None:
    assert sm.founded_data_groups() is None  # not decided before the first topic
    first = create(sm, "munich", 4, data_groups=3)
    assert sm.founded_data_groups() == 3
    assert list(first.partition_groups) == partition_groups(first.id, 4, 3)
    later = create(sm, "berlin", 4, data_groups=5)  # a leader configured otherwise
    assert list(later.partition_groups) == partition_groups(later.id, 4, 3)
    assert sm.data_groups() == 3
    assert [p.group for p in sm.describe("berlin").partitions] == list(later.partition_groups)


def test_one_data_group_places_everything_in_group_0(sm: StateMachine) -> None:
    topic = create(sm, "munich", 4, data_groups=0)  # 0: a leader from before groups
    assert not topic.partition_groups
    assert [p.group for p in sm.describe("munich").partitions] == [0, 0, 0, 0]
    assert sm.data_groups() == 1


def test_a_cluster_with_topics_from_before_groups_keeps_one_group(sm: StateMachine) -> None:
    with sm.env.begin(write=True) as txn:  # as if a topic had been made before groups
        txn.put(b"next_topic_id", (1).to_bytes(8, "big"), db=sm.meta)
    assert sm.founded_data_groups() == 1  # decided: the topic before groups is in group 0
    topic = create(sm, "munich", 4, data_groups=3)
    assert not topic.partition_groups and sm.data_groups() == 1
    assert sm.founded_data_groups() == 1


def test_data_groups_are_checked() -> None:
    peers = {1: "127.0.0.1:7400"}
    NodeConfig(node_id=1, peers=peers).validate()
    NodeConfig(node_id=1, peers=peers, data_groups=3).validate()
    NodeConfig(node_id=1, peers=peers, data_groups=0).validate()  # 0: one per voter
    with pytest.raises(ConfigError, match=r"data_groups: must be in 0\.\.64"):
        NodeConfig(node_id=1, peers=peers, data_groups=65).validate()
    with pytest.raises(ConfigError, match=r"data_groups: must be in 0\.\.64"):
        NodeConfig(node_id=1, peers=peers, data_groups=-1).validate()
    NodeConfig(node_id=0, bootstrap_expect=3, data_groups=2).validate()  # with discovery too
    # topics are placed in the data groups, unless told to stay in group 0
    assert NodeConfig(node_id=1, peers=peers, data_groups=3).placement_groups == 3
    assert (
        NodeConfig(node_id=1, peers=peers, data_groups=3, place_topics=False).placement_groups == 1
    )


def test_cluster_status_lists_each_group_with_its_partitions() -> None:
    status = {
        "leader": 2,
        "term": 7,
        "nodes": [
            {"id": 1, "role": "follower", "term": 7, "commit_index": 40, "applied_index": 39},
            {"id": 2, "role": "leader", "term": 7, "commit_index": 42, "applied_index": 42},
        ],
    }
    d = topics_pb2.TopicDescription(topic=topics_pb2.Topic(spec=topics_pb2.TopicSpec(name="a")))
    d.partitions.add(partition=0)
    d.partitions.add(partition=1)
    [g] = raft_groups(status, [d])
    assert g == {
        "id": 0,
        "leader": 2,
        "term": 7,
        "commit_index": 42,
        # each replica's lag: the group leader's commit minus its applied
        "replicas": [
            {"node": 1, "role": "follower", "applied_index": 39, "lag": 3},
            {"node": 2, "role": "leader", "applied_index": 42, "lag": 0},
        ],
        "partitions": [["a", 0], ["a", 1]],
        "partitions_known": True,
    }
    [unknown] = raft_groups(status, None)
    assert unknown["partitions"] == [] and unknown["partitions_known"] is False


def test_cluster_status_takes_each_groups_figures_from_the_nodes_views() -> None:
    """Each node tells every group it runs; a group's leader is the one the
    highest term names (a deposed leader's stale claim loses), its commit
    index that leader's; a group nobody leads shows leader 0."""

    def view(g: int, role: str, term: int, commit: int) -> dict[str, object]:
        return {"id": g, "role": role, "term": term, "commit_index": commit, "applied_index": 0}

    status = {
        "leader": 1,
        "term": 3,
        "nodes": [
            {
                "id": 1,
                "role": "leader",
                "groups": [view(0, "leader", 3, 9), view(1, "leader", 4, 5)],
            },
            {
                "id": 2,
                "role": "follower",
                "groups": [view(0, "follower", 3, 9), view(1, "leader", 6, 8)],
            },
            {
                "id": 3,
                "role": "follower",
                "groups": [view(0, "follower", 3, 8), view(2, "candidate", 2, 1)],
            },
            {"id": 4, "role": "down"},
        ],
    }
    d = topics_pb2.TopicDescription(topic=topics_pb2.Topic(spec=topics_pb2.TopicSpec(name="a")))
    d.partitions.add(partition=0, group=1)
    d.partitions.add(partition=1, group=2)
    groups = {g["id"]: g for g in raft_groups(status, [d])}
    assert sorted(groups) == [0, 1, 2]
    assert (groups[0]["leader"], groups[0]["term"], groups[0]["commit_index"]) == (1, 3, 9)
    assert (groups[1]["leader"], groups[1]["term"], groups[1]["commit_index"]) == (2, 6, 8)
    assert (groups[2]["leader"], groups[2]["term"], groups[2]["commit_index"]) == (0, 2, 1)
    assert groups[1]["partitions"] == [["a", 0]] and groups[2]["partitions"] == [["a", 1]]
