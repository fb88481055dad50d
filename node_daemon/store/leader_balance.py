"""Leaders spread over the nodes (docs/multiraft.md, step 4), and off a
node whose disk is low.

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

A leader whose own disk is low (``DiskGuard.low``: it refuses growing
writes, node_daemon/storage/disk.py) hands every group it leads, group 0
too, to a healthy voter whose disk is not known to be low: the group's
writes are taken again there, since the others have room. What a node
knows of its peers' disks is the bit each peer sets on every batch it
sends (``node_daemon.transport.peer_disk``): low, not low, or unknown (no
news lately), and unknown counts as not low (a healthy voter was heard
from lately, and its batches said). Among the candidates it takes the
group's preferred leader if that is one, else one that said lately it has
room, else the one holding the most of the log.

Invariants:
- Only a leader transfers, to the group's preferred voter when its own
  disk has room, to a healthy voter not known to be low when its own disk
  is low.
- Never to a voter whose disk is known to be low: the preferred leader
  is not handed its group back while it is low. A leader that is low
  and finds no voter with room keeps the group (every node low: writes
  stay refused, and leadership does not move round the nodes).
- A group is handed to its preferred leader at most once per
  ``min_interval_s``, and a node starts at most one transfer per decision
  round: a preferred node that keeps failing makes its group's leadership
  move at most that often. Gaining a group's leadership (an election, or a
  transfer such as ``roadlog-node transfer-leader``'s, or a low node's
  hand-over) counts as a move: the new leader keeps it for
  ``min_interval_s`` first, so a node drained on purpose is not handed its
  groups back at once.
- A low node hands a group off at most once per ``min_interval_s`` (its
  own last hand-over of that group), but does not wait for a group it
  just gained: the group's writes are refused while it leads. Low nodes
  do not toss a group between them: the node it goes to is not known to
  be low, a node known low is never handed a group, and with every node
  low nothing moves. (Only news gone stale, unknown, could let two low
  nodes hand it to each other, each at most once per interval; a voter
  healthy enough to be a candidate was heard from well within
  ``peer_disk.STALE_S``.)
- Sans-I/O: ``LeaderBalancer.decide`` takes each group's view and the time
  and returns the transfers to start; the caller starts them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

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
    # Each other voter as this leader sees it: heard from lately, within
    # CAUGHT_UP_SLACK entries of the leader's last, not catching up after a wipe.
    healthy: dict[int, bool] = field(default_factory=dict)
    low: bool = False  # this node's disk is low (it refuses growing writes)
    # Each other voter's disk as its latest batch said: True low, False not
    # low, None (or absent) unknown: no news lately.
    disk_low: Mapping[int, bool | None] = field(default_factory=dict)
    # Each other voter's match index (the most of the log it holds).
    match: Mapping[int, int] = field(default_factory=dict)


class Transfer(NamedTuple):
    """A hand-over to start: ``group`` to ``to``, and why."""

    group: int
    to: int
    # "preferred": to the group's preferred leader (leaders spread);
    # "disk_low": off this node, whose disk is low.
    why: Literal["preferred", "disk_low"]


def room_for(v: GroupView, node_id: int) -> int:
    """Whom a leader whose disk is low hands ``v``'s group to (0: none): a
    healthy voter other than itself whose disk is not known to be low; the
    group's preferred leader if it is one, else one that said it has room,
    else the one with the most of the log (then the lowest id)."""
    candidates = [
        n
        for n in sorted(v.voters)
        if n != node_id and v.healthy.get(n, False) and v.disk_low.get(n) is not True
    ]
    if not candidates:
        return 0
    preferred = preferred_leader(v.group, v.voters)
    if preferred in candidates:
        return preferred
    return min(candidates, key=lambda n: (v.disk_low.get(n) is not False, -v.match.get(n, 0), n))


@dataclass
class LeaderBalancer:
    node_id: int
    min_interval_s: float = MIN_INTERVAL_S
    last: dict[int, float] = field(default_factory=dict)  # group -> last move
    # group -> when this node last handed it off for its low disk
    last_disk: dict[int, float] = field(default_factory=dict)
    transfers: int = 0
    disk_transfers: int = 0  # of those, off this node's low disk
    leading: set[int] = field(default_factory=set)  # the groups it led at the last round

    def decide(self, now: float, views: Iterable[GroupView]) -> list[Transfer]:
        """The hand-overs to start now: at most one."""
        views = list(views)
        led = {v.group for v in views if v.leads}
        for g in led - self.leading:  # just gained: that was a move
            self.last[g] = now
        self.leading = led
        for v in views:
            if not v.leads or v.transferring:
                continue
            if v.low:
                # Off a low disk: at once, even a group just gained (its
                # writes are refused here), but once per interval per group.
                if now - self.last_disk.get(v.group, float("-inf")) < self.min_interval_s:
                    continue
                move = Transfer(v.group, room_for(v, self.node_id), "disk_low")
            else:
                if now - self.last.get(v.group, float("-inf")) < self.min_interval_s:
                    continue
                move = Transfer(v.group, preferred_leader(v.group, v.voters), "preferred")
                if v.disk_low.get(move.to) is True:
                    continue  # its disk is low: it would refuse the group's writes
            if move.to in (0, self.node_id) or not v.healthy.get(move.to, False):
                continue
            self.last[v.group] = now
            self.transfers += 1
            if move.why == "disk_low":
                self.last_disk[v.group] = now
                self.disk_transfers += 1
            return [move]
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


def view_of(
    group: int,
    core: object,
    low: bool = False,
    disk_low: Mapping[int, bool | None] | None = None,
) -> GroupView:
    """A group's view from its RaftCore (``node_daemon.raft.RaftCore``),
    this node's disk state (``low``) and its peers' (``disk_low``: node ->
    True, False or None, as ``PeerDisks.low`` tells)."""
    from node_daemon.raft import RaftCore, Role

    assert isinstance(core, RaftCore)
    leads = core.role == Role.LEADER
    voters = frozenset(core.conf.voters)
    healthy: dict[int, bool] = {}
    match: dict[int, int] = {}
    if leads:
        last = core.log.last_index()
        for node in sorted(voters - {core.id}):
            pr = core.prs.get(node)
            if pr is None:
                continue
            caught_up = pr.match + CAUGHT_UP_SLACK >= last
            healthy[node] = pr.recent_active and caught_up and not pr.catching_up
            match[node] = pr.match
    disks = {n: disk_low.get(n) for n in voters - {core.id}} if disk_low else {}
    return GroupView(group, leads, core.lead_transferee != 0, voters, healthy, low, disks, match)
