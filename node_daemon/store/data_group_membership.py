"""Data groups follow group 0's membership (docs/multiraft.md, step 6).

Group 0 decides who is in the cluster (``cluster_membership.Membership``: joins by
discovery, promotions, dead voters replaced, AddNode, RemoveNode, Leave).
Each data group's leader brings its own group's configuration toward group
0's latest one, one single-server change at a time (``next_change``), as
group 0's own changes are made:

1. a member of group 0 that the data group lacks is added as a learner;
2. a learner that is a voter in group 0 is promoted once it has caught up;
3. a voter that is only a learner in group 0 is removed (and comes back
   as a learner by rule 1);
4. a node group 0 no longer has is removed.

Adding before removing keeps the voters from shrinking below group 0's
while a replacement catches up. A leader never removes itself: it hands
the group to another voter first (``must_hand_over``), and the new leader
removes it. Everything here is decided from this node's own Raft state;
nothing is asked over the network.
"""

from __future__ import annotations

from collections.abc import Callable

from node_daemon.raft import ConfChange, ConfChangeType, ConfState


def next_change(
    meta: ConfState, group: ConfState, caught_up: Callable[[int], bool], leader: int
) -> ConfChange | None:
    """The next change that brings ``group`` (a data group's configuration,
    led by ``leader``) toward ``meta`` (group 0's); None when there is none
    to make now."""
    meta_members = meta.voters | meta.learners
    members = group.voters | group.learners
    for n in sorted(meta_members - members):
        return ConfChange(ConfChangeType.ADD_LEARNER, n)
    for n in sorted(meta.voters & group.learners):
        if caught_up(n):
            return ConfChange(ConfChangeType.ADD_VOTER, n)
    for n in sorted(group.voters & meta.learners):
        if n != leader and len(group.voters) > 1:
            return ConfChange(ConfChangeType.REMOVE_NODE, n)
    for n in sorted(members - meta_members):
        if n != leader and (n in group.learners or len(group.voters) > 1):
            return ConfChange(ConfChangeType.REMOVE_NODE, n)
    return None


def must_hand_over(meta: ConfState, leader: int) -> bool:
    """The data group's leader is no voter of group 0: it should hand the
    group to another voter (which then removes or demotes it)."""
    return leader not in meta.voters
