"""Who may see a consumer group (issue 39, finding 5).

A group belongs to one topic (``Group.topic``, fixed when its first join
made it), and its metadata (members, their client ids, the generation, the
committed offsets) is as much that topic's as its pings are: the rpcs that
name a group (``Rpc.group_topic`` in ``roadlog/rpc.py``: DescribeGroup,
ListGroups, Heartbeat, CommitOffsets, LeaveGroup) need ``read:`` for the
group's own topic, not for any topic.

Why here, on the node: the request names only the group, and only the
replicated state knows its topic. The queue server checks what it can (a
``read:`` scope for some topic: an identity with none is refused there,
as before) and sends the caller's scopes with the work item
(``WorkItem.scopes``, as it sends the caller's client id in
``WorkItem.principal``); the node checks them against the group's topic as
it reads the group, in the same read, so no group can be deleted and made
again under another topic between a check and the answer (asking the node
for the topic first would leave that gap, and cost a second round trip).
The node already judges what follows from the identity there (a member is
its identity's, a producer id too); the scopes follow the same road.

What a caller that may not read the group's topic sees: exactly what it
sees for a group that does not exist (``consumer_groups.no_group``,
NOT_FOUND, the same words), and ListGroups leaves the group out; so
neither a group's existence nor its topic is told (SECURITY.md). The one
thing it learns is what a name clash must tell: a JoinGroup naming a group
of another topic is refused without that topic (``name_taken``), since a
group's name is the whole cluster's.

An item without a principal (``client_auth = "none"``, the queue server's
own calls) is not checked: everything is allowed there, as before
identities. An item with a principal and no scopes (a queue server from
before ``WorkItem.scopes``) reads no group at all: it fails closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from node_daemon.state.consumer_groups import no_group
from roadlog.scopes import READ, Need, allows
from roadlog.v1 import groups_pb2, work_pb2

if TYPE_CHECKING:
    from node_daemon.state.machine import StateMachine


def may_read(item: work_pb2.WorkItem, topic: str) -> bool:
    """Whether the caller of ``item`` may read ``topic`` (its groups)."""
    return not item.principal or allows(item.scopes, Need(READ, topic))


def readable_group(
    sm: StateMachine, item: work_pb2.WorkItem, name: str
) -> groups_pb2.GroupDescription:
    """Group ``name`` with its offsets, if the caller of ``item`` may read
    its topic; NOT_FOUND, as for a group that does not exist, if not."""
    d = sm.describe_group(name)  # NOT_FOUND: no such group
    if not may_read(item, d.group.topic):
        raise no_group(name)
    return d


def readable_groups(sm: StateMachine, item: work_pb2.WorkItem) -> list[groups_pb2.GroupDescription]:
    """Every group whose topic the caller of ``item`` may read."""
    return sm.list_groups(lambda topic: may_read(item, topic))
