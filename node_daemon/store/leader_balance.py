"""Leaders spread over the nodes (docs/multiraft.md, step 4).

Each data group has a preferred leader: the voters in id order take the
data groups in turn (group g's is the ((g - 1) mod voters)-th voter), so
with as many data groups as voters each node leads one, and the write load
of the data groups is spread over every node's core. Group 0 has none: its
leader is wherever the last election put it.

The leader of a data group that is not its preferred leader hands the
group over (``transfer_leader``) once the preferred node is a healthy
follower: active lately, caught up to within ``CAUGHT_UP_SLACK`` entries of
the leader's last, not catching up after a wipe. The decision is made by each group's own leader
from its own Raft state: nothing is asked over the network.

Invariants:
- Only a leader transfers, and only to the group's preferred voter.
- A group is handed over at most once per ``min_interval_s``, and a node
  starts at most one transfer per decision round: a preferred node that
  keeps failing makes its group's leadership move at most that often.
  Gaining a group's leadership (an election, or a transfer such as
  ``roadlog-node transfer-leader``'s) counts as a move: the new leader keeps
  it for ``min_interval_s`` first, so a node drained on purpose is not
  handed its groups back at once.
- Sans-I/O: ``LeaderBalancer.decide`` takes each group's view and the time
  and returns the transfers to start; the caller starts them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

MIN_INTERVAL_S = 10.0  # per group, between two hand-overs
# Entries the preferred node may be behind and still count as caught up:
# under a steady stream of writes it is never exactly at the leader's last
# entry; the transfer itself catches it up before it campaigns.
CAUGHT_UP_SLACK = 100
ROUND_S = 1.0  # how often a node looks at the groups it leads


def preferred_leader(group: int, voters: Collection[int]) -> int:
    """Data group ``group``'s preferred leader among ``voters`` (0: none,
    for group 0 or without voters)."""
    if group <= 0 or not voters:
        return 0
    ordered = sorted(voters)
    return ordered[(group - 1) % len(ordered)]


@dataclass(frozen=True)
class GroupView:
    """What the leader of one group knows of it (see ``view_of``)."""

    group: int
    leads: bool  # this node leads the group now
    transferring: bool  # a transfer is already under way
    voters: frozenset[int]
    # The preferred node as this leader sees it: heard from lately, within
    # CAUGHT_UP_SLACK entries of the leader's last, not catching up after a wipe.
    healthy: dict[int, bool] = field(default_factory=dict)


@dataclass
class LeaderBalancer:
    node_id: int
    min_interval_s: float = MIN_INTERVAL_S
    last: dict[int, float] = field(default_factory=dict)  # group -> last move
    transfers: int = 0
    leading: set[int] = field(default_factory=set)  # the groups it led at the last round

    def decide(self, now: float, views: Iterable[GroupView]) -> list[tuple[int, int]]:
        """The (group, target) hand-overs to start now: at most one."""
        views = list(views)
        led = {v.group for v in views if v.leads}
        for g in led - self.leading:  # just gained: that was a move
            self.last[g] = now
        self.leading = led
        for v in views:
            if not v.leads or v.transferring:
                continue
            target = preferred_leader(v.group, v.voters)
            if target in (0, self.node_id) or not v.healthy.get(target, False):
                continue
            if now - self.last.get(v.group, float("-inf")) < self.min_interval_s:
                continue
            self.last[v.group] = now
            self.transfers += 1
            return [(v.group, target)]
        return []


def successor(core: object) -> int:
    """Whom a leader about to stop hands its group to: the voter (not
    itself) it heard from lately that holds the most of its log, not one
    catching up after a wipe; 0 if none."""
    from node_daemon.raft import RaftCore

    assert isinstance(core, RaftCore)
    best, best_match = 0, -1
    for node in sorted(core.conf.voters):
        pr = core.prs.get(node)
        if node == core.id or pr is None or not pr.recent_active or pr.catching_up:
            continue
        if pr.match > best_match:
            best, best_match = node, pr.match
    return best


def view_of(group: int, core: object) -> GroupView:
    """A group's view from its RaftCore (``node_daemon.raft.RaftCore``)."""
    from node_daemon.raft import RaftCore, Role

    assert isinstance(core, RaftCore)
    leads = core.role == Role.LEADER
    voters = frozenset(core.conf.voters)
    healthy: dict[int, bool] = {}
    if leads:
        last = core.log.last_index()
        target = preferred_leader(group, voters)
        pr = core.prs.get(target)
        if pr is not None and target != core.id:
            caught_up = pr.match + CAUGHT_UP_SLACK >= last
            healthy[target] = pr.recent_active and caught_up and not pr.catching_up
    return GroupView(group, leads, core.lead_transferee != 0, voters, healthy)
