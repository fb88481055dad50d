"""Data groups follow group 0's membership (node_daemon/store/data_group_membership.py):
from any configuration, the changes it proposes are each allowed (one
server at a time, never the last voter, never the leader itself) and lead
to group 0's configuration."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_daemon.raft import ConfChange, ConfChangeType, ConfState
from node_daemon.raft.confchange import apply_change
from node_daemon.store.data_group_membership import must_hand_over, next_change

pytestmark = pytest.mark.unit


def conf(voters: set[int], learners: set[int] | frozenset[int] = frozenset()) -> ConfState:
    return ConfState(frozenset(voters), frozenset(learners))


def always(_: int) -> bool:
    return True


def test_a_newcomer_is_added_as_learner_then_promoted_once_caught_up() -> None:
    meta = conf({1, 2, 3, 4})
    group = conf({1, 2, 3})
    assert next_change(meta, group, always, 1) == ConfChange(ConfChangeType.ADD_LEARNER, 4)
    group = conf({1, 2, 3}, {4})
    assert next_change(meta, group, lambda n: False, 1) is None  # 4 not caught up yet
    assert next_change(meta, group, always, 1) == ConfChange(ConfChangeType.ADD_VOTER, 4)
    assert next_change(meta, conf({1, 2, 3, 4}), always, 1) is None


def test_a_replacement_is_added_before_the_node_it_replaces_is_removed() -> None:
    meta = conf({1, 2, 4})  # group 0 replaced dead voter 3 by 4
    steps = []
    group = conf({1, 2, 3})
    while (cc := next_change(meta, group, always, 1)) is not None:
        steps.append(cc)
        group = apply_change(group, cc)
        assert len(group.voters) >= 3  # never fewer voters than group 0 has meanwhile
    assert steps == [
        ConfChange(ConfChangeType.ADD_LEARNER, 4),
        ConfChange(ConfChangeType.ADD_VOTER, 4),
        ConfChange(ConfChangeType.REMOVE_NODE, 3),
    ]
    assert group == meta


def test_the_leader_never_removes_itself_but_hands_over() -> None:
    meta = conf({2, 3})
    group = conf({1, 2, 3})
    assert next_change(meta, group, always, 1) is None
    assert must_hand_over(meta, 1)
    assert not must_hand_over(meta, 2)
    assert next_change(meta, group, always, 2) == ConfChange(ConfChangeType.REMOVE_NODE, 1)


ids = st.sets(st.integers(1, 7), max_size=7)


@settings(max_examples=300, deadline=None)
@given(meta_v=ids.filter(bool), meta_l=ids, group_v=ids.filter(bool), group_l=ids, data=st.data())
def test_any_configuration_converges_to_group_0s(
    meta_v: set[int], meta_l: set[int], group_v: set[int], group_l: set[int], data: st.DataObject
) -> None:
    meta = conf(meta_v, meta_l - meta_v)
    group = conf(group_v, group_l - group_v)
    # the data group's leader: one of its voters that group 0 keeps as a voter
    # (any other hands the group over first, as must_hand_over says)
    candidates = sorted(group.voters & meta.voters)
    if not candidates:
        return
    leader = data.draw(st.sampled_from(candidates))
    for _ in range(30):
        cc = next_change(meta, group, always, leader)
        if cc is None:
            break
        assert cc.node_id != leader or cc.type != ConfChangeType.REMOVE_NODE
        group = apply_change(group, cc)  # each step is allowed (raises otherwise)
    else:
        raise AssertionError("did not converge in 30 changes")
    assert group == meta
