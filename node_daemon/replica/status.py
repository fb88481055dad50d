"""The one builder of this node's status: Admin.Status, /readyz and the
logs all show what ``node_status`` says.

A Raft group's figures are read off its core in one place,
``group_figures``, as one ``GroupFigures``; every status and report of a
group is made from that value: ``group_status`` and ``node_status``
(Admin.Status, /readyz), the Work link's state for the queue servers
(``work.queue_link``, ``work.routing``), what a worker process tells the
main process of its groups and the main process tells a worker of group 0
(``process.pipe_messages``), discovery's word of the leader
(``process.serve``). A group another process of the node runs has the
figures that process last told (``figures_of``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node_daemon.raft import Role
from node_daemon.replica.remote import ReplicaView
from node_daemon.replica.replica import Replica
from roadlog.release import release
from roadlog.status import role_name
from roadlog.v1 import client_pb2


@dataclass(frozen=True, slots=True)
class GroupFigures:
    """One Raft group's figures on this node.

    Invariant: read off the group's core and state machine in one call
    (``group_figures``, within one turn of the event loop), so they are one
    moment's, never a mix of two; ``voters`` and ``learners`` sorted and
    disjoint (the configuration in force, ``conf_index`` its entry)."""

    group: int
    role: Role
    term: int
    leader: int  # the leader this node knows of (0: none)
    commit_index: int
    applied_index: int
    voters: tuple[int, ...]
    learners: tuple[int, ...]
    conf_index: int
    catching_up: bool  # lost its copy: votes again once caught up

    @property
    def is_leader(self) -> bool:
        return self.role == Role.LEADER

    def status(self) -> client_pb2.GroupStatus:
        """The group's status as Admin.Status shows it."""
        return client_pb2.GroupStatus(
            id=self.group,
            role=role_name(self.role.name),
            term=self.term,
            commit_index=self.commit_index,
            applied_index=self.applied_index,
            leader=self.leader,
            voters=self.voters,
            learners=self.learners,
            conf_index=self.conf_index,
            catching_up=self.catching_up,
        )


def group_figures(node: Replica) -> GroupFigures:
    """The figures of ``node``'s group, off its core and state machine now."""
    core = node.core
    conf = core.conf
    return GroupFigures(
        group=node.group,
        role=core.role,
        term=core.term,
        leader=core.lead,
        commit_index=core.log.committed,
        applied_index=node.sm.applied_index,
        voters=tuple(sorted(conf.voters)),
        learners=tuple(sorted(conf.learners)),
        conf_index=core.conf_index,
        catching_up=core.catching_up,
    )


def figures_of(node: ReplicaView) -> GroupFigures | None:
    """A group's figures on this node: its own when this process runs it,
    else as the process that runs it last told them (None: not yet)."""
    if isinstance(node, Replica):
        return group_figures(node)
    told: GroupFigures | None = getattr(node, "figures", None)
    return told


def group_status(node: ReplicaView) -> client_pb2.GroupStatus:
    """One Raft group's status on this node (a group another process of the
    node runs: as that process last told it; only its id before it did)."""
    figures = figures_of(node)
    return figures.status() if figures is not None else client_pb2.GroupStatus(id=node.group)


def node_status(node: Replica, figures: GroupFigures | None = None) -> client_pb2.NodeStatus:
    """The node's status: group 0's figures (``figures``, when the caller
    read them already for the same message), and each group's in
    ``groups``."""
    f = figures if figures is not None else group_figures(node)
    return client_pb2.NodeStatus(
        id=node.id,
        address=node.cfg.address,
        role=role_name(f.role.name),
        term=f.term,
        commit_index=f.commit_index,
        applied_index=f.applied_index,
        leader=f.leader,
        ready=node.serving,
        voters=f.voters,
        learners=f.learners,
        conf_index=f.conf_index,
        catching_up=f.catching_up,
        version=release(),
        groups=[
            f.status() if n is node else group_status(n)
            for _, n in sorted(node.raft_groups.items())
        ],
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
