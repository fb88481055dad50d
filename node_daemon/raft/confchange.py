"""Membership changes, one server at a time (Raft dissertation §4.1).

A configuration takes effect as soon as its entry is in a node's log, even
before it commits; a truncated configuration entry reverts the node to the
previous one. The leader allows one uncommitted configuration entry at a
time, and only after it has committed an entry of its own term. Each change
alters the voters by at most one node, so any majority of the old voters and
any majority of the new ones intersect.
"""

from __future__ import annotations

from node_daemon.raft.types import ConfChange, ConfChangeType, ConfState


def apply_change(conf: ConfState, cc: ConfChange) -> ConfState:
    """The configuration after ``cc``; ValueError when it is not allowed."""
    voters, learners = set(conf.voters), set(conf.learners)
    node = cc.node_id
    if node <= 0:
        raise ValueError(f"invalid node id {node}")
    if cc.type == ConfChangeType.ADD_LEARNER:
        if node in voters:
            raise ValueError(f"node {node} is a voter; remove it before adding it as learner")
        if node in learners:
            raise ValueError(f"node {node} is already a learner")
        learners.add(node)
    elif cc.type == ConfChangeType.ADD_VOTER:
        if node in voters:
            raise ValueError(f"node {node} is already a voter")
        learners.discard(node)
        voters.add(node)
    elif cc.type == ConfChangeType.REMOVE_NODE:
        if node not in voters and node not in learners:
            raise ValueError(f"node {node} is not a member")
        voters.discard(node)
        learners.discard(node)
        if not voters:
            raise ValueError("cannot remove the last voter")
    else:
        raise ValueError(f"unknown change {cc.type!r}")
    return ConfState(frozenset(voters), frozenset(learners))
