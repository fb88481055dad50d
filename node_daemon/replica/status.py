"""The one builder of this node's status: Admin.Status, /readyz and the
logs all show what ``node_status`` says."""

from __future__ import annotations

from typing import Any

from node_daemon.replica.remote import ReplicaView
from node_daemon.replica.replica import Replica
from roadlog.status import role_name
from roadlog.v1 import client_pb2


def group_status(node: ReplicaView) -> client_pb2.GroupStatus:
    """One Raft group's figures on this node (a group another process of the
    node runs: as that process last told them)."""
    if not isinstance(node, Replica):
        told = getattr(node, "status", None)
        return told if told is not None else client_pb2.GroupStatus(id=node.group)
    core = node.core
    return client_pb2.GroupStatus(
        id=node.group,
        role=role_name(core.role.name),
        term=core.term,
        commit_index=core.log.committed,
        applied_index=node.sm.applied_index,
        leader=core.lead,
        voters=sorted(core.conf.voters),
        learners=sorted(core.conf.learners),
        conf_index=core.conf_index,
        catching_up=core.catching_up,
    )


def node_status(node: Replica) -> client_pb2.NodeStatus:
    """The node's status: group 0's figures, and each group's in ``groups``."""
    core = node.core
    return client_pb2.NodeStatus(
        id=node.id,
        address=node.cfg.address,
        role=role_name(core.role.name),
        term=core.term,
        commit_index=core.log.committed,
        applied_index=node.sm.applied_index,
        leader=core.lead,
        ready=node.serving,
        voters=sorted(core.conf.voters),
        learners=sorted(core.conf.learners),
        conf_index=core.conf_index,
        catching_up=core.catching_up,
        groups=[group_status(n) for _, n in sorted(node.raft_groups.items())],
    )


def node_readiness(node: Replica, member: bool) -> tuple[bool, dict[str, Any]]:
    """/readyz: ready once the node knows a leader and is a member; the
    detail is its status (``node_id`` names it, as operators' tools expect)."""
    ns = node_status(node)
    return ns.ready and member, {
        "node_id": ns.id,
        "role": ns.role,
        "term": ns.term,
        "leader": ns.leader,
        "commit_index": ns.commit_index,
        "applied_index": ns.applied_index,
        "member": member,
    }
