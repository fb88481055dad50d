"""Leaders spread (docs/multiraft.md, step 4): who is each data group's
preferred leader, and when its current leader hands the group over; and
leaders move off a node whose disk is low, never onto one."""

from __future__ import annotations

import pytest

from node_daemon.store.leader_balance import (
    CAUGHT_UP_SLACK,
    GroupView,
    LeaderBalancer,
    Transfer,
    preferred_leader,
    room_for,
    view_of,
)
from tests.unit.support.raftkit import Net, new_core

pytestmark = pytest.mark.unit

VOTERS = frozenset({1, 2, 3})


def test_the_voters_take_the_data_groups_in_turn() -> None:
    assert [preferred_leader(g, VOTERS) for g in range(1, 7)] == [1, 2, 3, 1, 2, 3]
    assert preferred_leader(0, VOTERS) == 0  # group 0 has no preferred leader
    assert preferred_leader(1, ()) == 0
    assert preferred_leader(2, {9, 4}) == 9  # in id order, whatever the ids


def view(group: int, leads: bool = True, healthy: bool = True, moving: bool = False) -> GroupView:
    target = preferred_leader(group, VOTERS)
    return GroupView(group, leads, moving, VOTERS, {target: healthy})


def test_a_leader_hands_a_group_to_its_healthy_preferred_leader_once_per_interval() -> None:
    b = LeaderBalancer(node_id=1, min_interval_s=10)
    # group 1 is node 1's own; group 2 is node 2's, group 3 node 3's
    views = [view(1), view(2), view(3)]
    assert b.decide(0.0, views) == []  # just gained: kept a while
    assert b.decide(10.0, views) == [Transfer(2, 2, "preferred")]  # one per round
    assert b.decide(11.0, views) == [Transfer(3, 3, "preferred")]
    assert b.decide(12.0, views) == []  # both handed over lately
    assert b.decide(20.5, views) == [Transfer(2, 2, "preferred")]  # still leads it: again
    assert b.transfers == 3


def test_a_group_just_gained_is_kept_for_the_interval() -> None:
    """Leadership gained by an election or a transfer (an operator draining
    node 2) is kept min_interval_s before it goes back to its preferred node."""
    b = LeaderBalancer(node_id=1, min_interval_s=10)
    assert b.decide(0.0, [view(2, leads=False)]) == []
    assert b.decide(5.0, [view(2)]) == []  # node 2 handed it over at 5 s
    assert b.decide(14.9, [view(2)]) == []
    assert b.decide(15.0, [view(2)]) == [Transfer(2, 2, "preferred")]
    # Lost and gained again: the interval starts again.
    assert b.decide(16.0, [view(2, leads=False)]) == []
    assert b.decide(30.0, [view(2)]) == []
    assert b.decide(40.0, [view(2)]) == [Transfer(2, 2, "preferred")]


@pytest.mark.parametrize(
    "v",
    [
        view(2, leads=False),  # only a leader hands over
        view(2, healthy=False),  # not to a node that is down, behind or catching up
        view(2, moving=True),  # not while a transfer is under way
        view(1),  # already at its preferred leader
    ],
)
def test_no_hand_over(v: GroupView) -> None:
    assert LeaderBalancer(node_id=1).decide(0.0, [v]) == []


def test_the_view_of_a_core_tells_whether_the_preferred_node_is_caught_up() -> None:
    net = Net(new_core(i) for i in (1, 2, 3))
    assert view_of(2, net.cores[1]).leads is False
    net.elect(1)
    core = net.cores[1]
    v = view_of(2, core)
    assert v.leads and v.voters == VOTERS and v.healthy[2] is True  # heard and caught up
    assert view_of(1, core).healthy == {2: True, 3: True}  # every other voter
    assert view_of(0, core).healthy == {2: True, 3: True}
    core.propose_many([b"x"] * (CAUGHT_UP_SLACK + 10))
    net.stabilize()
    assert view_of(2, core).healthy == {2: True, 3: True}
    pr = core.prs[2]
    pr.match = core.log.last_index() - CAUGHT_UP_SLACK - 1
    assert view_of(2, core).healthy == {2: False, 3: True}  # too far behind
    pr.match = core.log.last_index()
    pr.recent_active = False
    assert view_of(2, core).healthy == {2: False, 3: True}  # not heard from lately
    core.transfer_leader(3)
    assert view_of(2, core).transferring


# ------------------------------------------------------------- a low disk


def low_view(
    group: int,
    low: bool = True,
    healthy: dict[int, bool] | None = None,
    disk_low: dict[int, bool | None] | None = None,
    match: dict[int, int] | None = None,
    leads: bool = True,
) -> GroupView:
    """Group ``group`` as node 1 sees it (node 1 leads it)."""
    return GroupView(
        group,
        leads,
        False,
        VOTERS,
        {2: True, 3: True} if healthy is None else healthy,
        low,
        {} if disk_low is None else disk_low,
        {2: 50, 3: 50} if match is None else match,
    )


def leading(node_id: int, *groups: int) -> LeaderBalancer:
    """A balancer of a node that has led ``groups`` a long while."""
    return LeaderBalancer(node_id=node_id, min_interval_s=10, leading=set(groups))


def test_a_low_leader_hands_its_groups_to_a_caught_up_voter_with_room() -> None:
    # Group 1 is node 1's own (the preferred leader is itself): it goes to
    # a voter that said it has room, the one holding the most of the log.
    b = leading(1, 1)
    v = low_view(1, disk_low={2: False, 3: False}, match={2: 40, 3: 60})
    assert b.decide(0.0, [v]) == [Transfer(1, 3, "disk_low")]
    assert b.transfers == 1 and b.disk_transfers == 1
    # Group 0 (no preferred leader) too.
    v = low_view(0, disk_low={2: False, 3: None})
    assert leading(1, 0).decide(0.0, [v]) == [
        Transfer(0, 2, "disk_low")  # said it has room: before one not heard of
    ]
    # A group whose preferred leader has room goes there.
    v = low_view(3, match={2: 90, 3: 10})
    assert leading(1, 3).decide(0.0, [v]) == [Transfer(3, 3, "disk_low")]
    # Unknown counts as not low.
    v = low_view(1, disk_low={2: None, 3: None})
    assert leading(1, 1).decide(0.0, [v]) == [Transfer(1, 2, "disk_low")]


def test_a_low_leader_hands_a_group_it_just_gained_on_at_once() -> None:
    """Its writes are refused while it leads: it does not keep the group
    the interval that a node with room keeps one it just gained."""
    b = LeaderBalancer(node_id=1, min_interval_s=10)
    assert b.decide(0.0, [low_view(1, leads=False)]) == []
    assert b.decide(1.0, [low_view(1)]) == [Transfer(1, 2, "disk_low")]  # just elected
    # With room, a group just gained is kept a while (test_a_group_just_gained...).
    b = LeaderBalancer(node_id=1, min_interval_s=10)
    assert b.decide(0.0, [view(2, leads=False)]) == []
    assert b.decide(1.0, [view(2)]) == []


def test_a_low_leader_never_hands_a_group_to_a_low_or_unhealthy_voter() -> None:
    # Node 3 holds more of the log, but its disk is low too.
    v = low_view(1, disk_low={2: False, 3: True}, match={2: 10, 3: 90})
    assert leading(1, 1).decide(0.0, [v]) == [Transfer(1, 2, "disk_low")]
    # Node 2 has room but is behind (not healthy): node 3 is low: nobody.
    v = low_view(1, healthy={2: False, 3: True}, disk_low={2: False, 3: True})
    assert leading(1, 1).decide(0.0, [v]) == []
    # Not its preferred leader either, when that one is low.
    v = low_view(3, disk_low={2: False, 3: True})
    assert leading(1, 3).decide(0.0, [v]) == [Transfer(3, 2, "disk_low")]


def test_every_node_low_moves_nothing() -> None:
    """Writes stay refused everywhere, and leadership does not go round."""
    b = LeaderBalancer(node_id=1, min_interval_s=10)
    views = [low_view(g, disk_low={2: True, 3: True}) for g in (0, 1, 2, 3)]
    for t in range(100):
        assert b.decide(float(t), views) == []
    assert b.transfers == 0


def test_a_low_leader_hands_each_group_at_most_once_per_interval() -> None:
    b = leading(1, 0, 1)
    views = [low_view(g) for g in (0, 1)]
    assert b.decide(0.0, views) == [Transfer(0, 2, "disk_low")]  # one per round
    assert b.decide(1.0, views) == [Transfer(1, 2, "disk_low")]
    # The transfers did not take (it still leads both): not again before 10 s.
    assert b.decide(2.0, views) == []
    assert b.decide(9.9, views) == []
    assert b.decide(10.0, views) == [Transfer(0, 2, "disk_low")]
    assert b.decide(11.0, views) == [Transfer(1, 2, "disk_low")]
    # Lost and gained again within the interval: still not again before it.
    assert b.decide(12.0, [low_view(0, leads=False)]) == []
    assert b.decide(13.0, [low_view(0)]) == []
    assert b.decide(20.0, [low_view(0)]) == [Transfer(0, 2, "disk_low")]
    # Not while a transfer is under way.
    moving = GroupView(1, True, True, VOTERS, {2: True, 3: True}, True)
    assert b.decide(30.0, [moving]) == []
    assert b.disk_transfers == b.transfers == 5


def test_the_preferred_leader_is_not_handed_its_group_back_while_it_is_low() -> None:
    """Node 2 took group 1 off node 1, whose disk is low: it keeps the group
    while node 1 is low; once node 1 says it has room again (or nothing
    lately: unknown counts as not low) the group goes back."""
    b = LeaderBalancer(node_id=2, min_interval_s=10)

    def held(one: bool | None) -> GroupView:
        return GroupView(1, True, False, VOTERS, {1: True, 3: True}, False, {1: one, 3: False})

    assert b.decide(0.0, [held(True)]) == []  # just gained
    for t in range(10, 60):
        assert b.decide(float(t), [held(True)]) == []
    assert b.decide(60.0, [held(False)]) == [Transfer(1, 1, "preferred")]  # room again
    assert b.transfers == 1 and b.disk_transfers == 0
    assert leading(2, 1).decide(0.0, [held(None)]) == [Transfer(1, 1, "preferred")]


def test_a_leader_with_room_and_a_healthy_preferred_ignores_the_others_disks() -> None:
    v = GroupView(2, True, False, VOTERS, {2: True, 3: True}, False, {2: False, 3: True})
    assert leading(1, 2).decide(0.0, [v]) == [Transfer(2, 2, "preferred")]
    # Not low itself: it keeps a group whose preferred leader is itself.
    assert leading(1, 1).decide(0.0, [low_view(1, low=False)]) == []


def test_room_for_picks_among_healthy_voters_not_known_low() -> None:
    assert room_for(low_view(0, healthy={2: False, 3: False}), 1) == 0
    assert room_for(low_view(0, disk_low={2: True, 3: True}), 1) == 0
    assert room_for(low_view(0, match={2: 5, 3: 7}), 1) == 3  # most of the log
    assert room_for(low_view(0, match={2: 7, 3: 7}), 1) == 2  # then the lowest id
    assert room_for(low_view(2, match={2: 1, 3: 7}), 1) == 2  # the preferred leader first


def test_the_view_of_a_core_carries_the_disks() -> None:
    net = Net(new_core(i) for i in (1, 2, 3))
    net.elect(1)
    core = net.cores[1]
    v = view_of(1, core, True, {2: True, 3: None, 9: False})
    assert v.low is True
    assert v.disk_low == {2: True, 3: None}  # the voters' only
    assert set(v.match) == {2, 3} and v.match[2] == core.prs[2].match
    assert view_of(1, core).disk_low == {} and view_of(1, core).low is False
    net.stabilize()
    b = LeaderBalancer(node_id=1, min_interval_s=0)
    assert b.decide(0.0, [view_of(1, core, True, {2: True, 3: False})]) == [
        Transfer(1, 3, "disk_low")
    ]
