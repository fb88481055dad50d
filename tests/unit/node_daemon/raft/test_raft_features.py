"""What the core adds to the paper's basics: pre-vote, check-quorum, the
pipelining window, fast backtracking, leadership transfer, ReadIndex,
learners and membership changes, snapshots and the Ready contract."""

from __future__ import annotations

import pytest

from node_daemon.raft import (
    ConfChange,
    ConfChangeType,
    Entry,
    EntryType,
    Message,
    MessageType,
    ProposalDropped,
    Ready,
    Role,
    Snapshot,
)
from node_daemon.raft.progress import Progress, ProgressState
from tests.unit.support.raftkit import Net, new_core, persist

pytestmark = pytest.mark.unit
MT = MessageType


def _role(net: Net, node: int) -> Role:
    return net.cores[node].role


def _state(pr: Progress) -> ProgressState:
    return pr.state


def _net(n: int = 3, **kw: object) -> Net:
    voters = tuple(range(1, n + 1))
    return Net([new_core(i, voters, seed=i, **kw) for i in voters])  # type: ignore[arg-type]


# ---------------------------------------------------------------- pre-vote


def test_pre_vote_does_not_raise_the_term_of_a_partitioned_node() -> None:
    net = _net(pre_vote=True, check_quorum=True)
    net.elect(1)
    term = net.cores[1].term
    net.isolate(3)
    for _ in range(100):
        net.cores[3].tick()
        net.stabilize()
    assert net.cores[3].term == term  # pre-votes never succeed, so no new term
    net.heal()
    net.tick_all(3)
    assert net.cores[1].role == Role.LEADER and net.cores[1].term == term


def test_without_pre_vote_a_partitioned_node_disrupts_on_return() -> None:
    net = _net(pre_vote=False, check_quorum=False)
    net.elect(1)
    term = net.cores[1].term
    net.isolate(3)
    for _ in range(100):
        net.cores[3].tick()
        net.stabilize()
    assert net.cores[3].term > term  # the contrast to the test above


def test_pre_vote_grants_only_to_an_up_to_date_log() -> None:
    r = new_core(1, log_terms=[1, 2], term=2)
    r.step(Message(MT.PRE_VOTE, 1, 2, 3, 1, 5))
    resp = [m for m in persist(r) if m.type == MT.PRE_VOTE_RESP]
    assert resp[0].reject and r.term == 2 and r.vote == 0


# ----------------------------------------------------------- check-quorum


def test_check_quorum_leader_steps_down_without_a_majority() -> None:
    net = _net(check_quorum=True, pre_vote=True)
    net.elect(1)
    net.isolate(1)
    leader = net.cores[1]
    for _ in range(2 * leader.cfg.election_tick + 1):
        leader.tick()
        net.stabilize()
    assert leader.role == Role.FOLLOWER


def test_leader_lease_ignores_votes_while_the_leader_is_alive() -> None:
    net = _net(check_quorum=True, pre_vote=True)
    net.elect(1)
    f = net.cores[2]
    term = f.term
    f.step(Message(MT.VOTE, 2, 3, term + 1, f.log.last_term(), f.log.last_index()))
    assert f.term == term
    assert not [m for m in persist(f) if m.type == MT.VOTE_RESP]


# ------------------------------------------------- replication and window


def test_replication_pipelines_up_to_the_inflight_window() -> None:
    r = new_core(1)
    r.cfg.max_inflight_msgs = 3
    for p in r.prs.values():
        p.inflights.max_count = 3
    r.campaign()
    r.step(Message(MT.VOTE_RESP, 1, 2, r.term))
    persist(r)
    r.step(Message(MT.APPEND_RESP, 1, 2, r.term, index=r.log.last_index()))
    persist(r)
    assert r.prs[2].state == ProgressState.REPLICATE
    sent = []
    for i in range(6):
        r.propose(b"%d" % i)
        sent += [m for m in persist(r) if m.type == MT.APPEND and m.to == 2 and m.entries]
    assert len(sent) == 3  # the window is full: three appends in flight, unacknowledged
    r.step(Message(MT.APPEND_RESP, 1, 2, r.term, index=sent[-1].entries[-1].index))
    more = [m for m in persist(r) if m.type == MT.APPEND and m.to == 2 and m.entries]
    assert more and more[0].entries[-1].index == r.log.last_index()


@pytest.mark.parametrize("lazy", [False, True])
def test_an_idle_followers_hears_a_new_commit_index_at_once(lazy: bool) -> None:
    net = _net(3, heartbeat_tick=5, lazy_commit=lazy)
    net.elect(1)
    leader = net.cores[1]
    leader.propose(b"x")
    net.stabilize()
    index = leader.log.last_index()
    assert leader.log.committed == index
    assert net.cores[2].log.committed == net.cores[3].log.committed == index


def test_lazy_commit_rides_on_the_next_append_while_entries_are_in_flight() -> None:
    net = _net(3, heartbeat_tick=5, lazy_commit=True)
    net.elect(1)
    leader = net.cores[1]
    leader.propose(b"a")
    leader.propose(b"b")
    msgs = persist(leader)  # two appends in flight to each follower
    first = [m for m in msgs if m.type == MT.APPEND and m.to == 2 and m.entries]
    assert len(first) == 2
    # The follower acknowledges the first entry only: commit moves, but the
    # second entry is still in flight, so no empty APPEND goes out for it.
    a = first[0].entries[-1].index
    leader.step(Message(MT.APPEND_RESP, 1, 2, leader.term, index=a))
    assert leader.log.committed == a
    assert not [m for m in persist(leader) if m.type == MT.APPEND and m.to == 2]
    # A new entry carries the new commit index along.
    leader.propose(b"c")
    carrier = [m for m in persist(leader) if m.type == MT.APPEND and m.to == 2]
    assert carrier and carrier[0].entries and carrier[0].commit == a
    # Had nothing carried it, the second tick would have told the commit index.
    leader.step(Message(MT.APPEND_RESP, 1, 2, leader.term, index=carrier[0].entries[-1].index))
    persist(leader)
    leader.prs[3].commit_sent = 0
    leader.tick()  # the next proposal may still carry it
    assert not [m for m in persist(leader) if m.type == MT.APPEND and m.to == 3]
    leader.tick()
    told = [m for m in persist(leader) if m.type == MT.APPEND and m.to == 3]
    assert told and told[0].commit == leader.log.committed


def _commit_only(net: Net, to: int, since: int) -> list[Message]:
    return [
        m for m in net.delivered[since:] if m.type == MT.APPEND and m.to == to and not m.entries
    ]


def test_under_steady_writes_a_caught_up_follower_gets_no_commit_only_append() -> None:
    net = _net(3, heartbeat_tick=5, lazy_commit=True)
    net.elect(1)
    leader = net.cores[1]
    net.tick_all(5)  # a heartbeat went: the tick count starts over
    start = len(net.delivered)
    first = leader.log.last_index() + 1
    for i in range(4):  # writes keep coming, each one replicated before the next
        leader.propose(b"w%d" % i)
        net.stabilize()
    index = leader.log.last_index()
    assert leader.log.committed == index
    for f in (2, 3):
        # The first write was a lone one, told at once; the next entry
        # carried each later commit.
        assert [m.commit for m in _commit_only(net, f, start)] == [first]
        appends = [m for m in net.delivered[start:] if m.type == MT.APPEND and m.to == f]
        assert len(appends) == 4 + 1  # one APPEND per entry, not two
        assert net.cores[f].log.committed == index - 1  # the last commit is not told yet
    # Nothing carried it: the second tick tells it (within a heartbeat).
    mark = len(net.delivered)
    for _ in range(2):
        leader.tick()
        net.stabilize()
    for f in (2, 3):
        assert [m.commit for m in _commit_only(net, f, mark)] == [index]
        assert net.cores[f].log.committed == index


def test_while_writes_keep_coming_followers_learn_each_commit_within_two_ticks() -> None:
    net = _net(3, heartbeat_tick=5, lazy_commit=True)
    net.elect(1)
    leader = net.cores[1]
    net.tick_all(5)
    committed_at_tick = [leader.log.committed]
    for t in range(12):  # heartbeats come too, every five ticks
        for i in range(3):  # three writes a tick, the last one still in flight
            leader.propose(b"t%d-%d" % (t, i))
            net.stabilize()
        leader.propose(b"t%d-in-flight" % t)
        for c in net.cores.values():
            c.tick()
        net.stabilize()
        committed_at_tick.append(leader.log.committed)
        if t >= 2:
            for f in (2, 3):
                assert net.cores[f].log.committed >= committed_at_tick[-3]


def test_a_lone_write_is_told_at_once_but_not_one_soon_after() -> None:
    net = _net(3, heartbeat_tick=5, lazy_commit=True)
    net.elect(1)
    leader = net.cores[1]
    net.tick_all(5)
    start = len(net.delivered)
    leader.propose(b"lone")
    net.stabilize()
    assert all(net.cores[f].log.committed == leader.log.last_index() for f in (2, 3))
    assert _commit_only(net, 2, start)  # an idle cluster's followers apply at once
    mark = len(net.delivered)
    leader.tick()
    leader.propose(b"second")  # within a heartbeat interval: writes keep coming
    net.stabilize()
    assert not _commit_only(net, 2, mark)


def test_prompt_commit_tells_each_commit_at_once_under_steady_writes() -> None:
    """For followers that serve reads closely following writes."""
    net = _net(3, heartbeat_tick=5, lazy_commit=True)
    net.elect(1)
    leader = net.cores[1]
    leader.set_prompt_commit(True)
    for i in range(4):
        leader.propose(b"w%d" % i)
        net.stabilize()
        index = leader.log.last_index()
        assert all(net.cores[f].log.committed == index for f in (2, 3))
    leader.set_prompt_commit(False)
    leader.propose(b"lazy again")
    net.stabilize()
    assert all(net.cores[f].log.committed == index for f in (2, 3))


def test_fast_backtracking_skips_a_whole_conflicting_term() -> None:
    leader = new_core(1, log_terms=[1, 1, 1, 4, 4, 4, 4, 4, 4, 4], term=5)
    follower = new_core(2, log_terms=[1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], term=5)
    net = Net([leader, follower, new_core(3, term=5)])
    net.elect(1)
    probes = [m for m in net.delivered if m.type == MT.APPEND and m.to == 2]
    assert len(probes) <= 3  # not one round trip per conflicting entry
    assert [follower.log.term(i) for i in range(1, 12)] == [
        leader.log.term(i) for i in range(1, 12)
    ]


def test_messages_respect_the_size_limit() -> None:
    net = _net()
    for c in net.cores.values():
        c.cfg.max_size_per_msg = 100
    net.elect(1)
    for _ in range(20):
        net.cores[1].propose(b"x" * 40)
    net.stabilize()
    big = [m for m in net.delivered if m.type == MT.APPEND and len(m.entries) > 2]
    assert not big
    assert net.cores[2].log.committed == net.cores[1].log.last_index()


def test_messages_respect_the_entry_count_limit() -> None:
    net = _net()
    for c in net.cores.values():
        c.cfg.max_entries_per_msg = 3
    net.elect(1)
    net.isolate(2)
    net.cores[1].propose_many([b"p%d" % i for i in range(20)])
    net.stabilize()
    net.heal()
    net.tick_all(2)
    to2 = [m for m in net.delivered if m.type == MT.APPEND and m.to == 2 and m.entries]
    assert to2 and max(len(m.entries) for m in to2) == 3
    assert net.cores[2].log.committed == net.cores[1].log.last_index()


# ---------------------------------------------------------------- transfer


def test_leadership_transfer_to_an_up_to_date_follower() -> None:
    net = _net()
    net.elect(1)
    net.cores[1].propose(b"x")
    net.stabilize()
    net.cores[1].transfer_leader(3)
    net.stabilize()
    assert net.cores[3].role == Role.LEADER
    assert net.cores[1].role == Role.FOLLOWER and net.cores[1].lead == 3


def test_leadership_transfer_catches_up_a_lagging_follower_first() -> None:
    net = _net()
    net.elect(1)
    net.isolate(3)
    for i in range(5):
        net.cores[1].propose(b"%d" % i)
    net.stabilize()
    net.heal()
    net.cores[1].transfer_leader(3)
    with pytest.raises(ProposalDropped):
        net.cores[1].propose(b"during transfer")
    net.stabilize()
    assert net.cores[3].role == Role.LEADER
    assert net.cores[3].log.last_index() >= 7


def test_transfer_to_a_learner_is_refused() -> None:
    r = new_core(1, (1, 2), learners=(3,))
    r.campaign()
    r.step(Message(MT.VOTE_RESP, 1, 2, r.term))
    with pytest.raises(ProposalDropped):
        r.transfer_leader(3)


# --------------------------------------------------------------- ReadIndex


def test_read_index_on_the_leader_waits_for_a_quorum_heartbeat() -> None:
    net = _net()
    net.elect(1)
    net.cores[1].propose(b"w")
    net.stabilize()
    leader = net.cores[1]
    leader.read_index(b"r1")
    rd = leader.ready()
    assert not rd.read_states  # no quorum confirmation yet
    hbs = [m for m in rd.messages if m.type == MT.HEARTBEAT and m.context == b"r1"]
    assert len(hbs) == 2
    leader.advance(rd)
    leader.step(Message(MT.HEARTBEAT_RESP, 1, 2, leader.term, context=b"r1"))
    rd = leader.ready()
    assert [(s.index, s.context) for s in rd.read_states] == [(leader.log.committed, b"r1")]


def test_read_index_from_a_follower_goes_through_the_leader() -> None:
    net = _net()
    net.elect(1)
    net.cores[1].propose(b"w")
    net.stabilize()
    f = net.cores[2]
    f.read_index(b"r2")
    states = []
    for _ in range(5):
        net.stabilize()
        states += f.read_states
        f.read_states.clear()
    rd_states = [m for m in net.delivered if m.type == MT.READ_INDEX_RESP]
    assert rd_states and rd_states[0].index == net.cores[1].log.committed


def test_read_index_isolated_leader_never_answers() -> None:
    net = _net()
    net.elect(1)
    net.isolate(1)
    net.cores[1].read_index(b"r3")
    net.stabilize()
    assert not net.cores[1].read_states
    assert not any(m.type == MT.READ_INDEX_RESP for m in net.delivered)


def test_read_index_waits_until_the_new_leader_commits_in_its_term() -> None:
    r = new_core(1, log_terms=[1], term=1)
    r.campaign()
    r.step(Message(MT.VOTE_RESP, 1, 2, r.term))
    r.read_index(b"early")
    assert r.pending_reads and len(r.read_only) == 0


# ------------------------------------------------------ membership changes


def test_learner_receives_the_log_but_does_not_vote() -> None:
    net = Net([new_core(i, (1, 2), learners=(3,), seed=i) for i in (1, 2, 3)])
    net.elect(1)
    net.cores[1].propose(b"x")
    net.stabilize()
    assert net.cores[3].log.committed == net.cores[1].log.committed
    for _ in range(100):
        net.cores[3].tick()
    assert net.cores[3].role == Role.FOLLOWER  # a learner never campaigns


def test_add_learner_then_promote() -> None:
    net = _net()
    net.elect(1)
    leader = net.cores[1]
    net.cores[4] = new_core(4, (), seed=4)
    net.applied[4] = []
    leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    net.stabilize()
    assert 4 in leader.conf.learners and 4 in net.cores[4].conf.learners
    leader.propose_conf_change(ConfChange(ConfChangeType.ADD_VOTER, 4))
    net.stabilize()
    assert leader.conf.voters == {1, 2, 3, 4}
    assert net.cores[4].conf.voters == {1, 2, 3, 4}
    assert net.cores[4].log.committed == leader.log.committed


def test_conf_index_says_whether_the_configuration_in_force_is_committed() -> None:
    net = _net()
    net.elect(1)
    leader = net.cores[1]
    before = leader.conf_index
    assert before <= leader.log.committed
    net.isolate(2)
    net.isolate(3)
    leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    net.stabilize()
    # In force at once on the leader, but not committed: a new leader may lack it.
    assert 4 in leader.conf.learners
    assert leader.conf_index == leader.log.last_index() > leader.log.committed
    net.heal()
    for _ in range(20):  # heartbeats find the followers behind and catch them up
        net.tick_all()
    assert leader.conf_index <= leader.log.committed
    assert net.cores[2].conf_index == leader.conf_index


def test_a_change_of_voters_needs_a_majority_of_them_heard_from_lately() -> None:
    """Finding 12: removing a live voter while another is silently down would
    leave a configuration in force on the leader that can commit nothing."""
    net = _net()
    net.elect(1)
    leader = net.cores[1]
    for _ in range(3):
        net.tick_all()
    net.isolate(3)  # down, and the leader does not know why
    for _ in range(leader.cfg.election_tick + 1):
        net.tick_all()
    assert leader.role == Role.LEADER  # 1 and 2 are a majority of {1, 2, 3}
    with pytest.raises(ProposalDropped, match=r"voters \[3\].*no working majority"):
        leader.propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 2))
    assert leader.conf.voters == {1, 2, 3}
    # Taking out the silent one leaves a live majority: allowed.
    leader.propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 3))
    net.stabilize()
    assert leader.conf.voters == {1, 2}
    assert leader.conf_index <= leader.log.committed


def test_only_one_configuration_change_at_a_time() -> None:
    net = _net()
    net.elect(1)
    net.isolate(2)
    net.isolate(3)
    leader = net.cores[1]
    leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))
    with pytest.raises(ProposalDropped, match="in progress"):
        leader.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 5))


def test_a_new_leader_changes_configuration_only_after_committing_in_its_term() -> None:
    r = new_core(1, log_terms=[1], term=1)
    r.campaign()
    r.step(Message(MT.VOTE_RESP, 1, 2, r.term))
    with pytest.raises(ProposalDropped, match="not committed"):
        r.propose_conf_change(ConfChange(ConfChangeType.ADD_LEARNER, 4))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (ConfChange(ConfChangeType.ADD_VOTER, 2), "already a voter"),
        (ConfChange(ConfChangeType.REMOVE_NODE, 9), "not a member"),
        (ConfChange(ConfChangeType.ADD_LEARNER, 0), "invalid node id"),
    ],
)
def test_invalid_changes_are_refused(change: ConfChange, reason: str) -> None:
    net = _net()
    net.elect(1)
    with pytest.raises(ProposalDropped, match=reason):
        net.cores[1].propose_conf_change(change)


def test_removing_the_leader_steps_it_down_once_committed() -> None:
    net = _net()
    net.elect(1)
    net.cores[1].propose_conf_change(ConfChange(ConfChangeType.REMOVE_NODE, 1))
    net.stabilize()
    assert net.cores[1].role == Role.FOLLOWER
    for c in (net.cores[2], net.cores[3]):
        assert c.conf.voters == {2, 3}
    net.tick_all(40)
    assert any(net.cores[i].role == Role.LEADER for i in (2, 3))
    assert _role(net, 1) != Role.LEADER


def test_a_truncated_configuration_entry_is_undone() -> None:
    f = new_core(2, term=2)
    conf_entry = Entry(2, 1, EntryType.CONFIG, new_core(9, (1, 2, 3, 4)).conf.encode())
    f.step(Message(MT.APPEND, 2, 1, 2, 0, 0, (conf_entry,)))
    assert f.conf.voters == {1, 2, 3, 4}
    # A leader of a later term overwrites index 1 with a normal entry.
    f.step(Message(MT.APPEND, 2, 3, 3, 0, 0, (Entry(3, 1, data=b"x"),)))
    assert f.conf.voters == {1, 2, 3}


# --------------------------------------------------------------- snapshots


def test_a_follower_behind_the_compacted_log_gets_a_snapshot() -> None:
    net = _net()
    net.elect(1)
    net.isolate(3)
    for i in range(10):
        net.cores[1].propose(b"%d" % i)
    net.stabilize()
    leader = net.cores[1]
    idx = leader.log.applied
    snap = Snapshot(leader.snapshot_meta_at(idx), b"state@%d" % idx)
    leader.log.storage.compact(snap)
    net.heal()
    net.tick_all(3)
    snaps = [m for m in net.delivered if m.type == MT.SNAPSHOT and m.to == 3]
    assert snaps and snaps[0].snapshot == snap
    leader.report_snapshot(3, ok=True)
    net.tick_all(3)
    f = net.cores[3]
    assert f.log.storage.snapshot().meta.index == idx
    assert f.log.committed == leader.log.committed
    assert f.conf == leader.conf


def test_a_failed_snapshot_is_retried() -> None:
    net = _net()
    net.elect(1)
    net.isolate(3)
    for i in range(5):
        net.cores[1].propose(b"%d" % i)
    net.stabilize()
    leader = net.cores[1]
    leader.log.storage.compact(Snapshot(leader.snapshot_meta_at(leader.log.applied), b"s"))
    leader.prs[3].recent_active = True
    leader.prs[3].become_probe()  # as after a rejection: next falls back to match + 1
    leader._send_append(3)
    assert leader.prs[3].state == ProgressState.SNAPSHOT
    leader.report_snapshot(3, ok=False)
    assert _state(leader.prs[3]) == ProgressState.PROBE
    net.heal()
    net.tick_all(3)
    assert net.cores[3].log.committed == leader.log.committed


# -------------------------------------------------------- Ready contract


def test_ready_is_empty_when_idle_and_applies_each_entry_once() -> None:
    net = _net()
    net.elect(1)
    for i in range(5):
        net.cores[1].propose(b"%d" % i)
    net.stabilize()
    for c in net.cores.values():
        assert not c.has_ready()
    for i, entries in net.applied.items():
        idx = [e.index for e in entries]
        assert idx == list(range(1, len(idx) + 1)), i
    assert len({tuple(e.data for e in ents) for ents in net.applied.values()}) == 1


def test_leader_counts_its_own_entries_only_once_persisted() -> None:
    r = new_core(1, (1,))
    r.campaign()
    assert r.role == Role.LEADER
    rd = r.ready()
    assert rd.entries and r.log.committed == 0  # not yet on our own disk
    r.log.storage.save(rd.hard_state, rd.entries, rd.snapshot)
    r.advance(rd)
    assert r.log.committed == rd.entries[-1].index


def test_restart_keeps_term_vote_and_log() -> None:
    r = new_core(1)
    r.campaign()
    persist(r)
    st = r.log.storage
    again = new_core(1, storage=st)  # type: ignore[arg-type]
    assert (again.term, again.vote) == (r.term, 1)
    assert again.log.last_index() == r.log.last_index()


def test_restart_refuses_a_state_machine_behind_the_snapshot() -> None:
    """A crash between saving a snapshot and installing it leaves the state
    machine behind; the core says so instead of skipping entries."""
    r = new_core(1, (1,))
    r.campaign()
    persist(r)
    r.propose(b"x")
    persist(r)
    st = r.log.storage
    st.compact(Snapshot(r.snapshot_meta_at(r.log.applied), b"state"))
    with pytest.raises(ValueError, match="behind the log's snapshot"):
        new_core(1, (1,), storage=st)  # type: ignore[arg-type]
    index = st.snapshot().meta.index
    again = new_core(1, (1,), storage=st, applied=index)  # type: ignore[arg-type]
    assert again.log.applied == index


def test_a_follower_that_lost_its_log_is_replicated_again() -> None:
    """A wiped disk: the follower rejects what it once acknowledged; the
    leader starts over for it instead of ignoring the rejections."""
    net = _net()
    net.elect(1)
    for i in range(10):
        net.cores[1].propose(b"%d" % i)
    net.stabilize()
    assert net.cores[1].prs[3].match == net.cores[1].log.last_index()
    net.cores[3] = new_core(3, seed=33)  # same id, empty disk
    net.applied[3] = []
    net.cores[1].propose(b"after the wipe")
    net.tick_all(5)
    assert net.cores[3].log.committed == net.cores[1].log.committed
    assert [net.cores[3].log.term(i) for i in range(1, net.cores[1].log.last_index() + 1)] == [
        net.cores[1].log.term(i) for i in range(1, net.cores[1].log.last_index() + 1)
    ]


def test_a_wiped_follower_is_noticed_by_heartbeats_alone() -> None:
    net = _net()
    net.elect(1)
    for i in range(5):
        net.cores[1].propose(b"%d" % i)
    net.stabilize()
    net.cores[3] = new_core(3, seed=34)  # same id, empty disk; nobody writes after this
    net.applied[3] = []
    net.tick_all(3)
    assert net.cores[3].log.last_index() == net.cores[1].log.last_index()
    assert net.cores[3].log.committed == net.cores[1].log.committed


# ------------------------------------------ between ready() and advance()


def _write_in_flight(net: Net, node: int) -> Ready:
    """Take ``node``'s Ready and leave it unpersisted (a write in flight)."""
    rd = net.cores[node].ready()
    assert rd.entries  # the test needs something being written
    return rd


def test_a_leaders_appends_leave_while_its_own_write_is_in_flight() -> None:
    net = _net()
    net.elect(1)
    leader = net.cores[1]
    leader.propose(b"a")
    rd = _write_in_flight(net, 1)
    leader.propose(b"b")
    early = leader.take_early_messages()
    assert {m.to for m in early} == {2, 3}
    assert all(m.type == MT.APPEND for m in early)
    assert [e.data for m in early for e in m.entries if e.data] == [b"b", b"b"]
    assert not leader.take_early_messages()  # taken once
    leader.log.storage.save(rd.hard_state, rd.entries, rd.snapshot, rd.must_sync)
    leader.advance(rd)
    nxt = leader.ready()
    assert not [m for m in nxt.messages if m.type == MT.APPEND and m.entries]  # not sent twice


def test_no_early_message_for_a_term_or_vote_not_yet_on_disk() -> None:
    net = _net()
    c = net.cores[1]
    c.campaign()
    rd = c.ready()  # the new term and the vote for itself: not yet durable
    assert rd.hard_state is not None and rd.hard_state.vote == 1
    for voter in (2, 3):
        c.step(Message(MT.VOTE_RESP, 1, voter, c.term))
    assert c.role == Role.LEADER
    assert not c.take_early_messages()  # its first appends wait for the vote's write
    c.log.storage.save(rd.hard_state, rd.entries, rd.snapshot, rd.must_sync)
    c.advance(rd)
    assert {m.to for m in c.take_early_messages() if m.type == MT.APPEND} == {2, 3}


def test_take_committed_gives_only_entries_on_disk_once_each() -> None:
    net = _net()
    net.elect(1)
    leader = net.cores[1]
    start = leader.log.applied
    leader.propose(b"a")
    rd_a = leader.ready()
    leader.log.storage.save(rd_a.hard_state, rd_a.entries, rd_a.snapshot, rd_a.must_sync)
    early = list(rd_a.messages)
    leader.advance(rd_a)
    a = rd_a.entries[-1].index
    leader.propose(b"b")
    rd_b = _write_in_flight(net, 1)  # b is being written on the leader
    early += rd_b.split_messages()[0]
    # the followers persist a (and b, sent early) and answer
    for m in early:
        net.cores[m.to].step(m)
    for f in (2, 3):
        for m in persist(net.cores[f]):
            if m.to == 1:
                leader.step(m)
    b = a + 1
    assert leader.log.committed == b  # the followers alone are a quorum for b
    got = leader.take_committed()
    assert [e.index for e in got] == list(range(start + 1, a + 1))  # b is not on our disk yet
    assert not leader.take_committed()  # nothing more until those are applied
    leader.applied_to(a)
    assert not leader.take_committed()  # b still in flight
    leader.log.storage.save(rd_b.hard_state, rd_b.entries, rd_b.snapshot, rd_b.must_sync)
    leader.advance(rd_b)
    nxt = leader.ready()
    assert [e.index for e in nxt.committed_entries] == [b]  # a is never applied twice
    assert leader.log.applied == a


def test_a_new_leader_is_caught_up_only_once_it_applied_an_entry_of_its_term() -> None:
    """``leads_caught_up``: what a leader checks before proposing may be read
    from its state only once that state holds every entry its predecessors
    committed, i.e. once an entry of its own term is applied."""
    net = _net()
    net.elect(1)
    net.cores[1].propose(b"a write of term 1's leader")
    net.stabilize()
    one, two = net.cores[1], net.cores[2]
    before = net.applied[1][-1]
    assert before.data == b"a write of term 1's leader"
    assert one.leads_caught_up(before.index)
    assert not two.leads_caught_up(net.applied[2][-1].index)  # a follower never is
    net.elect(2)
    assert two.role == Role.LEADER and two.term > before.term
    # Applied up to the old leader's last write, not yet its own term's first entry:
    assert not two.leads_caught_up(before.index)
    first_of_term = net.applied[2][-1]
    assert first_of_term.term == two.term and first_of_term.index > before.index
    assert two.leads_caught_up(first_of_term.index)
    assert not one.leads_caught_up(net.applied[1][-1].index)  # it no longer leads
