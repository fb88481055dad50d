"""Lazy ticks (``tick_due.ticks_until_action``): the ticks before the one it
names change nothing of a core but its counters (no message, no role, term
or leader change), in every state a cluster goes through (followers,
candidates, a leader with heartbeats, check-quorum and lazy commits
untold, a learner); and a leader's heartbeat tick is named exactly."""

from __future__ import annotations

import copy
import random

import pytest

from node_daemon.raft import RaftCore, Role
from node_daemon.replica.tick_due import ticks_until_action
from tests.unit.support.raftkit import Net, new_core, persist

pytestmark = pytest.mark.unit


def _cores(learner: bool) -> list[RaftCore]:
    voters = (1, 2, 3)
    learners = (4,) if learner else ()
    return [
        new_core(
            i,
            voters,
            learners=learners,
            election_tick=10,
            heartbeat_tick=3,
            pre_vote=True,
            check_quorum=True,
            lazy_commit=True,
            seed=i,
        )
        for i in (*voters, *learners)
    ]


def _quiet_until_due(core: RaftCore) -> int:
    """Tick a copy of ``core`` up to the tick ``ticks_until_action`` names;
    assert the ones before it change nothing but counters. Returns k."""
    c = copy.deepcopy(core)
    persist(c)  # what it had to say already
    k = ticks_until_action(c)
    assert k >= 1
    before = (c.role, c.term, c.lead, c.vote, c.log.committed)
    for i in range(k - 1):
        c.tick()
        assert persist(c) == [], f"tick {i + 1} of {k - 1} sent messages"
        assert (c.role, c.term, c.lead, c.vote, c.log.committed) == before
    return k


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("learner", [False, True])
def test_no_tick_before_the_one_named_acts(seed: int, learner: bool) -> None:
    rng = random.Random(seed)
    net = Net(_cores(learner))
    for _ in range(60):
        for core in net.cores.values():
            _quiet_until_due(core)
        step = rng.random()
        if step < 0.5:
            net.cores[rng.choice(list(net.cores))].tick()
        elif step < 0.8:
            net.tick_all(rng.randint(1, 4))
        else:
            leader = next((c for c in net.cores.values() if c.role == Role.LEADER), None)
            if leader is not None:
                leader.propose(b"x%d" % rng.randrange(1000))
        if rng.random() < 0.2:
            net.isolate(rng.choice([1, 2, 3]))
        elif rng.random() < 0.3:
            net.heal()
        net.stabilize()


def test_a_leaders_heartbeat_tick_is_named_exactly() -> None:
    net = Net(_cores(False))
    net.elect(1)
    net.tick_all(7)  # the commit of its first entry told: only heartbeats are due
    leader = net.cores[1]
    persist(leader)
    k = _quiet_until_due(leader)
    assert k <= leader.cfg.heartbeat_tick
    for _ in range(k):
        leader.tick()
    assert any(m.type.name == "HEARTBEAT" for m in persist(leader))
