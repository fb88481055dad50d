"""Which Raft group holds each partition of a topic (issue 18, multi-raft).

Group 0 is the metadata group; with one data group (``data_groups = 1``,
today's clusters) it holds everything, pings included. With G > 1 data
groups, partition ``p`` of topic ``t`` lives in data group
``1 + (t + p) mod G``: a topic's consecutive partitions on consecutive
groups, each topic starting one group further, so that topics with fewer
partitions than groups still spread. The map is computed once, when the
topic is created, and stored in its record (``Topic.partition_groups``),
so that a cluster's groups can grow later for new topics without moving
old ones.
"""

from __future__ import annotations

import os

from roadlog.v1 import topics_pb2

METADATA_GROUP = 0
MAX_DATA_GROUPS = 64
# The file in a node's data directory recording the data groups it was
# founded with when none were configured (node_daemon/store/founded_data_groups.py).
DATA_GROUPS_RECORD = "data_groups"


def worker_processes(data_groups: int, workers: int) -> int:
    """How many worker processes a node runs its data groups in (``workers``
    config key; 0: one per core this process may run on), at most one per
    data group; 1: none, every group in the node's main process (as with
    one data group)."""
    if data_groups <= 1:
        return 1
    want = workers or len(os.sched_getaffinity(0))
    return max(1, min(want, data_groups))


def partition_groups(topic_id: int, partitions: int, data_groups: int) -> list[int]:
    """Each partition's group; ``[]`` (every partition in group 0) for one
    data group."""
    if not 1 <= data_groups <= MAX_DATA_GROUPS:
        raise ValueError(f"data_groups must be in 1..{MAX_DATA_GROUPS}, not {data_groups}")
    if data_groups == 1:
        return []
    return [1 + (topic_id + p) % data_groups for p in range(partitions)]


def group_of(topic: topics_pb2.Topic, partition: int) -> int:
    """The group holding ``partition`` of ``topic`` (0 for topics without a
    map: one group, or made before groups)."""
    groups = topic.partition_groups
    return int(groups[partition]) if groups else METADATA_GROUP
