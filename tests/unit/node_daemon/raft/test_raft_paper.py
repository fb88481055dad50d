"""The rules of the Raft paper (Figure 2 and §5.4), one test per sentence,
in the manner of etcd-io/raft's raft_paper_test.go.

Pre-vote and check-quorum are off here unless a test says otherwise: the
paper's plain election is what is being checked.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from node_daemon.raft import Entry, Message, MessageType, ProposalDropped, Role
from tests.unit.support.raftkit import Net, new_core, persist, tick_until_campaign

pytestmark = pytest.mark.unit
MT = MessageType


def _append(
    to: int,
    frm: int,
    term: int,
    index: int,
    log_term: int,
    ents: Iterable[Entry] = (),
    commit: int = 0,
) -> Message:
    return Message(MT.APPEND, to, frm, term, log_term, index, tuple(ents), commit)


# §5.1 "If one server's current term is smaller than the other's, then it
# updates its current term to the larger value. If a candidate or leader
# discovers that its term is out of date, it immediately reverts to follower."


@pytest.mark.parametrize("role", ["follower", "candidate", "leader"])
def test_update_term_from_message(role: str) -> None:
    r = new_core(1)
    if role == "candidate":
        r.campaign()
    elif role == "leader":
        r.campaign()
        r.step(Message(MT.VOTE_RESP, 1, 2, r.term))
        assert r.role == Role.LEADER
    r.step(_append(1, 2, 5, 0, 0))
    assert r.term == 5
    assert r.role == Role.FOLLOWER
    assert r.lead == 2


# §5.1 "If a server receives a request with a stale term number, it rejects
# the request."


def test_reject_stale_term_message() -> None:
    r = new_core(1, term=3)
    persist(r)
    r.step(_append(1, 2, 2, 0, 0, [Entry(2, 1)]))
    assert r.log.last_index() == 0
    msgs = persist(r)
    assert [(m.type, m.term) for m in msgs] == [(MT.APPEND_RESP, 3)]


# §5.2 "When servers start up, they begin as followers."


def test_start_as_follower() -> None:
    r = new_core(1)
    assert r.role == Role.FOLLOWER
    assert r.lead == 0


# §5.2 "Leaders send periodic heartbeats (AppendEntries RPCs that carry no
# log entries) to all followers in order to maintain their authority."


def test_leader_broadcasts_heartbeats() -> None:
    hb = 2
    r = new_core(1, heartbeat_tick=hb)
    r.campaign()
    r.step(Message(MT.VOTE_RESP, 1, 2, r.term))
    persist(r)
    for _ in range(hb):
        r.tick()
    msgs = [m for m in persist(r) if m.type == MT.HEARTBEAT]
    assert sorted(m.to for m in msgs) == [2, 3]
    assert all(m.term == r.term and not m.entries for m in msgs)


# §5.2 "If a follower receives no communication over a period of time called
# the election timeout, then it ... begins an election": it increments its
# term, votes for itself and issues RequestVote RPCs to each other server.


@pytest.mark.parametrize("as_candidate", [False, True])
def test_election_starts_after_timeout(as_candidate: bool) -> None:
    r = new_core(1)
    if as_candidate:
        r.campaign()
        persist(r)
    term0 = r.term
    r.election_elapsed = 0
    for _ in range(2 * r.cfg.election_tick):
        r.tick()
    assert r.term == term0 + 1
    assert r.role == Role.CANDIDATE
    assert r.vote == 1
    votes = [m for m in persist(r) if m.type == MT.VOTE and m.term == r.term]
    assert sorted(m.to for m in votes) == [2, 3]


# §5.2 "A candidate wins an election if it receives votes from a majority of
# the servers in the full cluster for the same term."


@pytest.mark.parametrize(
    ("size", "grants", "rejects", "expected"),
    [
        (1, {}, {}, Role.LEADER),
        (3, {2}, set(), Role.LEADER),
        (3, {2, 3}, set(), Role.LEADER),
        (3, set(), set(), Role.CANDIDATE),
        (5, {2}, set(), Role.CANDIDATE),
        (5, {2, 3}, set(), Role.LEADER),
        (5, {2}, {3, 4}, Role.CANDIDATE),
        (5, {2}, {3, 4, 5}, Role.FOLLOWER),
        (3, set(), {2, 3}, Role.FOLLOWER),
    ],
)
def test_election_in_one_round(
    size: int, grants: set[int], rejects: set[int], expected: Role
) -> None:
    voters = range(1, size + 1)
    r = new_core(1, voters)
    r.campaign()
    for v in sorted(grants):
        r.step(Message(MT.VOTE_RESP, 1, v, r.term))
    for v in sorted(rejects):
        r.step(Message(MT.VOTE_RESP, 1, v, r.term, reject=True))
    assert r.role == expected
    assert r.term == 1


# §5.2 "Each server will vote for at most one candidate in a given term, on a
# first-come-first-served basis."


@pytest.mark.parametrize(
    ("voted", "candidate", "granted"), [(0, 2, True), (0, 3, True), (2, 2, True), (3, 2, False)]
)
def test_follower_votes_once_per_term(voted: int, candidate: int, granted: bool) -> None:
    r = new_core(1, term=1)
    r.vote = voted
    r.step(Message(MT.VOTE, 1, candidate, 1, 0, 0))
    resp = [m for m in persist(r) if m.type == MT.VOTE_RESP]
    assert len(resp) == 1 and resp[0].reject is (not granted)


# §5.2 "While waiting for votes, a candidate may receive an AppendEntries RPC
# from another server claiming to be leader. If the leader's term is at
# least as large as the candidate's current term, then the candidate
# recognizes the leader as legitimate and returns to follower state."


@pytest.mark.parametrize("term_delta", [0, 1])
def test_candidate_falls_back_to_follower(term_delta: int) -> None:
    r = new_core(1)
    r.campaign()
    term = r.term + term_delta
    r.step(_append(1, 2, term, 0, 0))
    assert r.role == Role.FOLLOWER
    assert r.term == term and r.lead == 2


# §5.2 "Raft uses randomized election timeouts": in [et, 2 * et).


def test_election_timeouts_are_randomized() -> None:
    seen = set()
    for seed in range(60):
        r = new_core(1, seed=seed)
        ticks = 0
        while r.role == Role.FOLLOWER:
            r.tick()
            ticks += 1
        seen.add(ticks)
    et = 10
    assert min(seen) >= et and max(seen) < 2 * et
    assert len(seen) > 3


def test_election_timeouts_are_deterministic_per_seed() -> None:
    def timeout(seed: int) -> int:
        r = new_core(1, seed=seed)
        tick_until_campaign(r)
        return r.randomized_election_timeout

    assert [timeout(s) for s in range(10)] == [timeout(s) for s in range(10)]


# §5.3 "Once a leader has been elected, it begins servicing client requests.
# ... The leader appends the command to its log as a new entry, then issues
# AppendEntries RPCs in parallel to each of the other servers."


def _leader3() -> tuple[Net, int]:
    net = Net([new_core(i) for i in (1, 2, 3)])
    net.elect(1)
    assert net.cores[1].role == Role.LEADER
    return net, net.cores[1].log.last_index()


def test_leader_starts_replication() -> None:
    r = new_core(1)
    r.campaign()
    r.step(Message(MT.VOTE_RESP, 1, 2, r.term))
    persist(r)
    # Followers acknowledge the leader's empty entry.
    li = r.log.last_index()
    for f in (2, 3):
        r.step(Message(MT.APPEND_RESP, 1, f, r.term, index=li))
    persist(r)
    idx = r.propose(b"some data")
    msgs = [m for m in persist(r) if m.type == MT.APPEND and m.entries]
    assert sorted(m.to for m in msgs) == [2, 3]
    for m in msgs:
        assert m.index == li and m.log_term == r.term
        assert [(e.index, e.term, e.data) for e in m.entries] == [(idx, r.term, b"some data")]


# §5.3 "A log entry is committed once the leader that created the entry has
# replicated it on a majority of the servers ... the leader ... includes that
# index in future AppendEntries RPCs."


@pytest.mark.parametrize(
    ("size", "acks", "committed"),
    [
        (1, set(), True),
        (3, set(), False),
        (3, {2}, True),
        (5, {2}, False),
        (5, {2, 3}, True),
        (5, {2, 3, 4, 5}, True),
    ],
)
def test_leader_acknowledges_commit(size: int, acks: set[int], committed: bool) -> None:
    voters = range(1, size + 1)
    r = new_core(1, voters)
    r.campaign()
    for v in voters:
        if v != 1:
            r.step(Message(MT.VOTE_RESP, 1, v, r.term))
    persist(r)
    li = r.log.last_index()
    for v in voters:
        if v != 1:
            r.step(Message(MT.APPEND_RESP, 1, v, r.term, index=li))
    persist(r)
    idx = r.propose(b"x")
    persist(r)
    for v in sorted(acks):
        r.step(Message(MT.APPEND_RESP, 1, v, r.term, index=idx))
    msgs = persist(r)
    assert (r.log.committed >= idx) is committed
    if committed and size > 1:
        assert any(m.type == MT.APPEND and m.commit == idx for m in msgs)


# §5.3 "This also commits all preceding entries in the leader's log,
# including entries created by previous leaders."


def test_leader_commits_preceding_entries() -> None:
    r = new_core(1, log_terms=[2, 2, 3], term=3)
    r.campaign()
    r.step(Message(MT.VOTE_RESP, 1, 2, r.term))
    persist(r)
    r.step(Message(MT.APPEND_RESP, 1, 2, r.term, index=r.log.last_index()))
    persist(r)
    assert r.log.committed == 4  # 3 old entries + the new leader's empty entry


# §5.3 "Once a follower learns that a log entry is committed, it applies the
# entry to its local state machine (in log order)."


def test_follower_commits_and_applies_in_order() -> None:
    r = new_core(1, term=1)
    ents = [Entry(1, 1, data=b"a"), Entry(1, 2, data=b"b"), Entry(1, 3, data=b"c")]
    r.step(_append(1, 2, 1, 0, 0, ents, commit=2))
    rd = r.ready()
    assert [e.data for e in rd.committed_entries] == [b"a", b"b"]
    r.log.storage.save(rd.hard_state, rd.entries, rd.snapshot)
    r.advance(rd)
    assert r.log.applied == 2


# §5.3 "If the follower does not find an entry in its log with the same index
# and term, then it refuses the new entries."


@pytest.mark.parametrize(
    ("index", "log_term", "reject"),
    [(0, 0, False), (1, 1, False), (2, 2, False), (3, 3, True), (2, 1, True), (5, 2, True)],
)
def test_follower_checks_previous_entry(index: int, log_term: int, reject: bool) -> None:
    r = new_core(1, log_terms=[1, 2], term=2)
    r.step(_append(1, 2, 3, index, log_term, [Entry(3, index + 1)]))
    resp = [m for m in persist(r) if m.type == MT.APPEND_RESP]
    assert len(resp) == 1 and resp[0].reject is reject


# §5.3 "If an existing entry conflicts with a new one (same index but
# different terms), delete the existing entry and all that follow it; append
# any new entries not already in the log."


@pytest.mark.parametrize(
    ("index", "log_term", "ents", "want_terms"),
    [
        (2, 2, [(3, 3)], [1, 2, 3]),
        (1, 1, [(3, 2), (4, 3)], [1, 3, 4]),
        (0, 0, [(1, 1)], [1, 2]),
        (0, 0, [(3, 1)], [3]),
    ],
)
def test_follower_appends_and_truncates(
    index: int, log_term: int, ents: list[tuple[int, int]], want_terms: list[int]
) -> None:
    r = new_core(1, log_terms=[1, 2], term=2)
    entries = [Entry(t, i) for t, i in ents]
    r.step(_append(1, 2, 4, index, log_term, entries))
    persist(r)
    got = [r.log.term(i) for i in range(1, r.log.last_index() + 1)]
    assert got == want_terms


# §5.3 Figure 7: "the leader handles inconsistencies by forcing the
# followers' logs to duplicate its own."


FIG7_LEADER = [1, 1, 1, 4, 4, 5, 5, 6, 6, 6]
FIG7_FOLLOWERS = {
    "a": [1, 1, 1, 4, 4, 5, 5, 6, 6],
    "b": [1, 1, 1, 4],
    "c": [1, 1, 1, 4, 4, 5, 5, 6, 6, 6, 6],
    "d": [1, 1, 1, 4, 4, 5, 5, 6, 6, 6, 7, 7],
    "e": [1, 1, 1, 4, 4, 4, 4],
    "f": [1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3],
}


@pytest.mark.parametrize("case", sorted(FIG7_FOLLOWERS))
def test_leader_brings_follower_log_into_consistency(case: str) -> None:
    leader = new_core(1, log_terms=FIG7_LEADER, term=8)
    follower = new_core(2, log_terms=FIG7_FOLLOWERS[case], term=7)
    # A third voter that votes for the leader, so that the leader wins.
    voter = new_core(3, log_terms=[], term=7)
    net = Net([leader, follower, voter])
    net.elect(1)
    assert leader.role == Role.LEADER
    leader.propose(b"after")
    net.stabilize()
    n = leader.log.last_index()
    assert follower.log.last_index() == n
    assert [follower.log.term(i) for i in range(1, n + 1)] == [
        leader.log.term(i) for i in range(1, n + 1)
    ]
    assert follower.log.committed == leader.log.committed == n


# §5.4.1 "RequestVote RPC ... includes information about the candidate's log":
# its last index and last term.


def test_vote_request_carries_last_entry() -> None:
    r = new_core(1, log_terms=[1, 2, 2], term=2)
    r.campaign()
    votes = [m for m in persist(r) if m.type == MT.VOTE]
    assert votes and all((m.index, m.log_term, m.term) == (3, 2, 3) for m in votes)


# §5.4.1 "the voter denies its vote if its own log is more up-to-date than
# that of the candidate": a later last term wins; with equal last terms the
# longer log wins.


@pytest.mark.parametrize(
    ("voter_log", "cand_index", "cand_term", "granted"),
    [
        ([1, 1], 2, 1, True),
        ([1, 1], 3, 1, True),
        ([1, 1], 1, 1, False),
        ([1, 2], 2, 1, False),
        ([1, 2], 1, 3, True),
        ([2, 2], 5, 1, False),
    ],
)
def test_voter_applies_the_election_restriction(
    voter_log: list[int], cand_index: int, cand_term: int, granted: bool
) -> None:
    r = new_core(1, log_terms=voter_log, term=3)
    r.step(Message(MT.VOTE, 1, 2, 4, cand_term, cand_index))
    resp = [m for m in persist(r) if m.type == MT.VOTE_RESP]
    assert len(resp) == 1 and resp[0].reject is (not granted)


# §5.4.2 "Raft never commits log entries from previous terms by counting
# replicas. Only log entries from the leader's current term are committed by
# counting replicas" (Figure 8).


def test_leader_only_commits_entries_of_its_term_by_counting() -> None:
    r = new_core(1, log_terms=[1, 2], term=2)
    r.campaign()  # term 3
    r.step(Message(MT.VOTE_RESP, 1, 2, r.term))
    assert r.role == Role.LEADER
    persist(r)
    # A follower reports that it holds index 2 (from term 2): a majority has
    # it, but it is from an earlier term, so it is not committed yet.
    r.step(Message(MT.APPEND_RESP, 1, 2, r.term, index=2))
    persist(r)
    assert r.log.committed == 0
    # Once the leader's own entry (index 3, term 3) is on a majority, both commit.
    r.step(Message(MT.APPEND_RESP, 1, 2, r.term, index=3))
    persist(r)
    assert r.log.committed == 3


def test_figure8_an_entry_of_an_old_term_on_a_majority_may_still_be_overwritten() -> None:
    """Figure 8 (c)-(d): S1 leads term 4 with (2, term 2) on S1-S3, a
    majority; S5 holds (2, term 3). Had S1 committed (2, 2) by counting, S5
    could still win and overwrite it. Raft does not commit it, so nothing
    committed is lost."""
    logs = {1: [1, 2], 2: [1, 2], 3: [1, 2], 4: [1], 5: [1, 3]}
    s = {i: new_core(i, (1, 2, 3, 4, 5), log_terms=logs[i], term=3, seed=i) for i in logs}
    s[1].campaign()
    for v in (2, 3):
        s[1].step(Message(MT.VOTE_RESP, 1, v, s[1].term))
    assert s[1].role == Role.LEADER and s[1].term == 4
    persist(s[1])
    for v in (2, 3):
        s[1].step(Message(MT.APPEND_RESP, 1, v, 4, index=2))
    persist(s[1])
    assert s[1].log.committed == 0  # (2, term 2) is on a majority, yet not committed
    # S1 fails before its own entry of term 4 spreads; S5 wins term 5 with S2-S4.
    net = Net([s[i] for i in (2, 3, 4, 5)])
    net.elect(5)
    assert s[5].role == Role.LEADER
    for i in (2, 3, 4):
        assert s[i].log.term(2) == 3  # the old entry was overwritten, safely


def test_only_the_leader_accepts_proposals() -> None:
    net, _ = _leader3()
    with pytest.raises(ProposalDropped) as e:
        net.cores[2].propose(b"x")
    assert e.value.leader == 1


def test_a_granted_vote_carries_the_callers_context_and_nothing_else_does() -> None:
    """``Config.vote_context`` (the node's log clock reading, issue 21
    finding 21) rides on a granted VOTE_RESP only: not on a refusal, not on
    a pre-vote's answer."""
    r = new_core(1, term=1)
    r.cfg.vote_context = lambda: b"reading"
    r.step(Message(MT.PRE_VOTE, 1, 2, 2, 0, 0))
    r.step(Message(MT.VOTE, 1, 2, 1, 0, 0))
    r.step(Message(MT.VOTE, 1, 3, 1, 0, 0))  # already voted for 2: refused
    resp = {(m.type, m.to): m for m in persist(r) if m.type in (MT.VOTE_RESP, MT.PRE_VOTE_RESP)}
    assert resp[(MT.PRE_VOTE_RESP, 2)].context == b""
    assert not resp[(MT.VOTE_RESP, 2)].reject and resp[(MT.VOTE_RESP, 2)].context == b"reading"
    assert resp[(MT.VOTE_RESP, 3)].reject and resp[(MT.VOTE_RESP, 3)].context == b""
