"""Data groups follow group 0's topics (node_daemon/store/data_group_topics.py): the
ops a data group's leader proposes, and a data group's state machine (real
LMDB) taking a placed topic's appends and reads, and dropping it."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.state.machine import StateMachine
from node_daemon.store.data_group_topics import next_topic_op
from roadlog.errors import Code
from roadlog.v1 import command_pb2, topics_pb2
from tests.unit.node_daemon.state.test_state_machine import Log, pings, read_all

pytestmark = pytest.mark.unit

T0 = 1_800_000_000_000


def topic(name: str, tid: int, groups: list[int]) -> topics_pb2.Topic:
    return topics_pb2.Topic(
        spec=topics_pb2.TopicSpec(name=name, partitions=len(groups) or 4),
        id=tid,
        partition_groups=groups,
    )


def test_ops_drop_what_group_0_no_longer_has_then_place_what_it_has() -> None:
    a, b = topic("a", 1, [1, 2, 1, 2]), topic("b", 2, [2, 2, 2, 2])
    meta = {"a": a, "b": b}
    assert next_topic_op(meta, {}, 1) == command_pb2.Op(
        place_topic=command_pb2.PlaceTopicOp(topic=a)
    )
    assert next_topic_op(meta, {"a": a}, 1) is None  # b has nothing in group 1
    assert next_topic_op(meta, {"a": a}, 2).place_topic.topic == b  # type: ignore[union-attr]
    assert next_topic_op({}, {"a": a}, 1) == command_pb2.Op(
        delete_topic=command_pb2.DeleteTopicOp(name="a")
    )
    again = topic("a", 7, [1, 1, 1, 1])  # deleted and made again in group 0
    assert next_topic_op({"a": again}, {"a": a}, 1).delete_topic.name == "a"  # type: ignore[union-attr]
    assert next_topic_op({"a": again}, {}, 1).place_topic.topic.id == 7  # type: ignore[union-attr]
    assert next_topic_op({"z": topic("z", 3, [])}, {}, 1) is None  # all in group 0


def test_a_data_group_takes_appends_for_a_placed_topic_and_drops_it(tmp_path: Path) -> None:
    meta = StateMachine(tmp_path / "meta")
    data = StateMachine(tmp_path / "data")
    try:
        created = Log(meta).create("munich", partitions=4)
        record = created.topic
        # group 0 placed it in data groups (by hand here: CreateTopicOp.data_groups)
        del record.partition_groups[:]
        record.partition_groups.extend([1, 2, 1, 2])
        d = Log(data)
        assert d.append(pings(10))[0] == Code.NOT_FOUND  # not placed yet: refused
        op = next_topic_op({"munich": record}, data.topic_records(), 1)
        assert op is not None and op.HasField("place_topic")
        assert d.run(command_pb2.Command(leader_ms=T0, ops=[op])) == [(Code.OK, b"", "")]
        assert d.run(command_pb2.Command(leader_ms=T0, ops=[op]))[0][0] == Code.OK  # again: no-op
        assert data.topic_records()["munich"].id == record.id
        code, resp, msg = d.append(pings(10))
        assert code == Code.OK, msg
        assert sum(o.count for o in resp.offsets) == 10
        stored = sum(len(read_all(data, p)) for p in range(4))
        assert stored == 10
        other = topics_pb2.Topic()
        other.CopyFrom(record)
        other.id = record.id + 1
        clash = command_pb2.Op(place_topic=command_pb2.PlaceTopicOp(topic=other))
        [(code, _, _)] = d.run(command_pb2.Command(leader_ms=T0, ops=[clash]))
        assert code == Code.FAILED_PRECONDITION  # another id under the same name
        drop = next_topic_op({}, data.topic_records(), 1)
        assert drop is not None and drop.HasField("delete_topic")
        assert d.run(command_pb2.Command(leader_ms=T0, ops=[drop]))[0][0] == Code.OK
        assert data.topic_records() == {}
    finally:
        meta.close()
        data.close()
