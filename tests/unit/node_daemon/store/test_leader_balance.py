"""Leaders spread (docs/multiraft.md, step 4): who is each data group's
preferred leader, and when its current leader hands the group over."""

from __future__ import annotations

import pytest

from node_daemon.store.leader_balance import (
    CAUGHT_UP_SLACK,
    GroupView,
    LeaderBalancer,
    preferred_leader,
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
    assert b.decide(0.0, [view(1), view(2), view(3)]) == []  # just gained: kept a while
    assert b.decide(10.0, [view(1), view(2), view(3)]) == [(2, 2)]  # one per round
    assert b.decide(11.0, [view(1), view(2), view(3)]) == [(3, 3)]
    assert b.decide(12.0, [view(1), view(2), view(3)]) == []  # both handed over lately
    assert b.decide(20.5, [view(1), view(2), view(3)]) == [(2, 2)]  # still leads it: again
    assert b.transfers == 3


def test_a_group_just_gained_is_kept_for_the_interval() -> None:
    """Leadership gained by an election or a transfer (an operator draining
    node 2) is kept min_interval_s before it goes back to its preferred node."""
    b = LeaderBalancer(node_id=1, min_interval_s=10)
    assert b.decide(0.0, [view(2, leads=False)]) == []
    assert b.decide(5.0, [view(2)]) == []  # node 2 handed it over at 5 s
    assert b.decide(14.9, [view(2)]) == []
    assert b.decide(15.0, [view(2)]) == [(2, 2)]
    # Lost and gained again: the interval starts again.
    assert b.decide(16.0, [view(2, leads=False)]) == []
    assert b.decide(30.0, [view(2)]) == []
    assert b.decide(40.0, [view(2)]) == [(2, 2)]


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
    assert v.leads and v.voters == VOTERS and v.healthy == {2: True}  # heard and caught up
    assert view_of(1, core).healthy == {}  # its own group: nobody to hand it to
    core.propose_many([b"x"] * (CAUGHT_UP_SLACK + 10))
    net.stabilize()
    assert view_of(2, core).healthy == {2: True}
    pr = core.prs[2]
    pr.match = core.log.last_index() - CAUGHT_UP_SLACK - 1
    assert view_of(2, core).healthy == {2: False}  # too far behind
    pr.match = core.log.last_index()
    pr.recent_active = False
    assert view_of(2, core).healthy == {2: False}  # not heard from lately
    core.transfer_leader(3)
    assert view_of(2, core).transferring
