"""A node that lost its storage catches up before it votes again
(``Config.catching_up``; issue 21, nemesis finding 2): it neither votes nor
campaigns, leaders count it in no commit or read quorum, and it is released
once it holds a leader's catch-up mark and enough voters that are not
catching up hold it too."""

from __future__ import annotations

import random

import pytest

from node_daemon.raft import (
    ConfChange,
    ConfChangeType,
    Config,
    Message,
    MessageType,
    ProposalDropped,
    RaftCore,
    Role,
    bootstrap,
)
from node_daemon.raft.storage import MemoryStorage
from node_daemon.transport.wire import message_from_pb, message_to_pb
from tests.unit.support.raftkit import Net, new_core, persist

pytestmark = pytest.mark.unit
MT = MessageType
VOTERS = (1, 2, 3)


def wiped(
    node: int,
    *,
    check_quorum: bool = False,
    pre_vote: bool = False,
    voters: tuple[int, ...] = VOTERS,
) -> RaftCore:
    """``node`` started again on an empty disk: the static peers' bootstrap,
    catching up (what the node daemon does)."""
    st = MemoryStorage()
    bootstrap(st, voters)
    cfg = Config(
        node,
        election_tick=10,
        heartbeat_tick=1,
        pre_vote=pre_vote,
        check_quorum=check_quorum,
        catching_up=True,
    )
    return RaftCore(cfg, st, random.Random(node))


def fresh_net(pre_vote: bool = False) -> Net:
    """Three bootstrapped nodes, each started empty: a brand-new cluster
    whose nodes do not know yet that it is one."""
    return Net([wiped(i, pre_vote=pre_vote) for i in VOTERS])


def _net(**kw: object) -> Net:
    return Net([new_core(i, VOTERS, seed=i, **kw) for i in VOTERS])  # type: ignore[arg-type]


def write(net: Net, leader: int, n: int) -> None:
    for i in range(n):
        net.cores[leader].propose(b"w%d" % i)
    net.stabilize()


def test_a_node_catching_up_neither_campaigns_nor_votes() -> None:
    net = fresh_net(pre_vote=True)
    for _ in range(100):
        net.tick_all()
    assert all(c.role == Role.FOLLOWER and c.term == 1 for c in net.cores.values())
    core = net.cores[1]
    for kind in (MT.PRE_VOTE, MT.VOTE):
        core.step(Message(kind, 1, 2, 2, log_term=1, index=1))
        (resp,) = [m for m in persist(core) if m.to == 2]
        assert resp.reject, kind
    core.step(Message(MT.TIMEOUT_NOW, 1, 2, core.term))
    core.campaign()
    assert core.role == Role.FOLLOWER


def test_a_new_cluster_elects_once_its_nodes_know_it_is_new() -> None:
    net = fresh_net(pre_vote=True)
    for c in net.cores.values():
        c.known_new_cluster()
    net.elect(1)
    assert net.cores[1].role == Role.LEADER
    write(net, 1, 3)
    assert {c.log.committed for c in net.cores.values()} == {net.cores[1].log.last_index()}


def test_a_wiped_voter_and_a_lagging_one_cannot_elect_a_leader_without_an_acked_write() -> None:
    """The integration test's story in the core: 3 lags, 1 and 2 commit;
    2 is wiped and 1 goes down; 3 cannot be elected with 2's vote; 1 comes
    back, is elected, and every replica ends with the write."""
    net = _net(pre_vote=True)
    net.elect(1)
    net.isolate(3)
    write(net, 1, 5)
    acked = net.cores[1].log.committed
    acked_terms = [net.cores[1].log.term(i) for i in range(1, acked + 1)]
    assert net.cores[3].log.last_index() < acked
    net.cores[2] = wiped(2, pre_vote=True)
    net.applied[2] = []
    net.heal()
    net.isolate(1)
    for _ in range(200):
        net.tick_all()
    assert all(c.role != Role.LEADER for i, c in net.cores.items() if i != 1)
    net.heal()
    for _ in range(200):
        net.tick_all()
        if net.cores[1].role == Role.LEADER and not net.cores[2].catching_up:
            break
    assert net.cores[1].role == Role.LEADER
    write(net, 1, 1)
    for c in net.cores.values():
        assert [c.log.term(i) for i in range(1, acked + 1)] == acked_terms
        assert c.log.committed == net.cores[1].log.committed
    assert not net.cores[2].catching_up
    assert net.cores[2].vote == 1  # it votes for no one else in this term


def test_a_leader_counts_a_node_catching_up_in_no_quorum() -> None:
    net = _net(check_quorum=True)
    net.elect(1)
    write(net, 1, 2)
    leader = net.cores[1]
    net.cores[2] = wiped(2, check_quorum=True)
    net.applied[2] = []
    net.isolate(3)
    net.cores[1].propose(b"needs a real majority")
    net.stabilize()
    net.tick_all(3)
    assert leader.prs[2].catching_up
    assert leader.prs[2].match == leader.log.last_index()  # replicated to it...
    assert leader.log.committed < leader.log.last_index()  # ...but not counted
    assert net.cores[2].catching_up  # so nothing proves this leader current to it
    with pytest.raises(ProposalDropped):
        leader.transfer_leader(2)
    leader.read_index(b"r")
    net.stabilize()
    assert not leader.read_states  # its heartbeat acks confirm no read either
    net.tick_all(2 * leader.cfg.election_tick)
    # Check-quorum counts it (it hears this leader): were the leader to step
    # down, no one could be elected to catch it up while 3 is away.
    assert leader.role == Role.LEADER and net.cores[2].catching_up
    net.heal()
    for _ in range(300):
        net.tick_all()
        if any(c.role == Role.LEADER for c in net.cores.values()) and not net.cores[2].catching_up:
            break
    new = next(c for c in net.cores.values() if c.role == Role.LEADER)
    assert new.id != 2
    write(net, new.id, 1)
    assert {c.log.committed for c in net.cores.values()} == {new.log.last_index()}
    assert not new.prs[2].catching_up


def test_a_stale_leader_cannot_release_a_node_that_forgot_a_newer_term() -> None:
    """2 voted for 3 in a newer term, then lost its disk; 1, the leader of
    an older term that has not heard of it, reaches 2 first: 2 takes its
    entries but 1 commits nothing with them, so 2 stays catching up (and
    would not vote in the term it forgot)."""
    net = _net()
    net.elect(1)
    write(net, 1, 2)
    old = net.cores[1].term
    net.isolate(1)
    net.elect(3)  # with 2's vote
    assert net.cores[3].role == Role.LEADER and net.cores[3].term > old
    net.cores[2] = wiped(2)
    net.applied[2] = []
    net.heal()
    net.isolate(3)
    committed = net.cores[1].log.committed
    net.cores[1].propose(b"a stale leader's write")
    net.stabilize()
    net.tick_all(3)
    assert net.cores[1].log.committed == committed
    assert net.cores[2].catching_up


def test_released_only_once_the_vote_is_on_disk() -> None:
    net = _net()
    net.elect(1)
    write(net, 1, 1)
    net.cores[2] = two = wiped(2)
    net.applied[2] = []
    assert not two.caught_up_durably()
    net.cores[1].propose(b"x")
    net.stabilize()
    assert not two.catching_up and two.caught_up_durably()
    assert two.log.storage.initial_state().vote == 1


def test_catching_up_crosses_the_wire() -> None:
    m = Message(MT.APPEND_RESP, 1, 2, 3, index=4, catching_up=True)
    assert message_from_pb(message_to_pb(m)) == m


def test_in_two_voters_the_other_one_releases_it_and_gets_its_vote() -> None:
    """Voters {1, 2}: every majority holds 1, so 1 alone proves itself
    current to a wiped 2, and 2 may vote for 1 (the only other voter) even
    while it catches up: otherwise no leader could ever be elected again."""
    voters = (1, 2)
    net = Net([new_core(i, voters, seed=i, check_quorum=True) for i in voters])
    net.elect(1)
    write(net, 1, 3)
    net.cores[2] = wiped(2, check_quorum=True, voters=voters)
    net.applied[2] = []
    net.tick_all(3)
    assert not net.cores[2].catching_up and net.cores[2].vote == 1
    write(net, 1, 1)
    assert net.cores[2].log.committed == net.cores[1].log.last_index()
    # And a new election needs the wiped one's vote: it gives it.
    net.cores[2] = wiped(2, check_quorum=True, voters=voters)
    net.applied[2] = []
    net.cores[1] = new_core(1, voters, seed=5, check_quorum=True, storage=net.cores[1].log.storage)  # type: ignore[arg-type]
    net.elect(1)
    assert net.cores[1].role == Role.LEADER


def test_in_four_voters_two_of_the_others_prove_the_leader_current() -> None:
    """Voters {1..4}, a majority is 3: one of every majority 4 voted with is
    among any two others, so 1 and 2 holding the mark release 4 while 3 is
    away, though they cannot commit (3 of 4 needed, 4 not counted)."""
    voters = (1, 2, 3, 4)
    net = Net([new_core(i, voters, seed=i) for i in voters])
    net.elect(1)
    write(net, 1, 2)
    net.cores[4] = wiped(4, voters=voters)
    net.applied[4] = []
    net.isolate(3)
    committed = net.cores[1].log.committed
    net.cores[1].propose(b"x")
    net.stabilize()
    net.tick_all(2)
    assert not net.cores[4].catching_up
    net.tick_all(2)
    assert net.cores[1].log.committed > committed  # 4 counts again: 1, 2, 4


def test_no_configuration_change_leaves_a_majority_catching_up() -> None:
    net = _net(check_quorum=True)
    net.elect(1)
    write(net, 1, 1)
    net.isolate(2)  # so that 3 stays catching up: 1 alone holds the mark
    net.cores[3] = wiped(3, check_quorum=True)
    net.applied[3] = []
    net.tick_all(2)
    assert net.cores[1].prs[3].catching_up and net.cores[3].catching_up
    with pytest.raises(ProposalDropped, match="catching up"):
        net.cores[1].propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 2))
    net.cores[1].propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))  # voters stay
