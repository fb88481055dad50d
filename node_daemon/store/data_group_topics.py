"""Data groups follow group 0's topics (docs/multiraft.md, "Topics in the
data groups").

Group 0 holds the topics (create, delete). A data group stores the pings of
the partitions placed in it, and needs each such topic's record (id,
partitions, retention) to take appends, serve reads and trim. Its leader
compares the group's placed topics with group 0's (both replicated on
every node, so both local) and proposes in its own group, one op at a
time (``next_topic_op``):

1. a placed topic that group 0 no longer has, or has under another id (it
   was deleted and made again), is deleted here, with its pings;
2. a topic of group 0 with a partition in this group that is not placed
   here yet is placed (``PlaceTopicOp``: the record as group 0 keeps it).

Dropping before placing lets a topic made again under the same name take
its new id. Nothing is asked over the network.
"""

from __future__ import annotations

from collections.abc import Mapping

from roadlog.v1 import command_pb2, topics_pb2


def next_topic_op(
    meta: Mapping[str, topics_pb2.Topic], placed: Mapping[str, topics_pb2.Topic], group: int
) -> command_pb2.Op | None:
    """The next op that brings data group ``group``'s topics toward group
    0's (``meta``); None when they agree."""
    for name in sorted(placed):
        m = meta.get(name)
        if m is None or m.id != placed[name].id:
            return command_pb2.Op(delete_topic=command_pb2.DeleteTopicOp(name=name))
    for name in sorted(meta):
        topic = meta[name]
        if name not in placed and group in topic.partition_groups:
            return command_pb2.Op(place_topic=command_pb2.PlaceTopicOp(topic=topic))
    return None
