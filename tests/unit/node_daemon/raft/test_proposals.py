"""PendingProposals: each proposal is answered exactly once, as applied or
as lost, and a proposal whose entry left the log is lost at once."""

from __future__ import annotations

import pytest

from node_daemon.raft import Entry, MemoryStorage, PendingProposals, Snapshot
from node_daemon.raft.log import RaftLog
from node_daemon.raft.types import SnapshotMeta

pytestmark = pytest.mark.unit


def _log(*terms: int) -> RaftLog:
    log = RaftLog(MemoryStorage())
    log.append([Entry(t, i + 1) for i, t in enumerate(terms)])
    return log


def test_the_entry_applied_with_the_proposals_term_answers_it() -> None:
    p: PendingProposals[str] = PendingProposals()
    p.add(1, 2, "a")
    p.add(2, 2, "b")
    mine, lost = p.applied([Entry(2, 1), Entry(2, 2)])
    assert [(e.index, w) for e, w in mine] == [(1, "a"), (2, "b")]
    assert lost == [] and len(p) == 0


def test_another_entry_applied_at_the_index_or_past_it_loses_the_proposal() -> None:
    p: PendingProposals[str] = PendingProposals()
    p.add(3, 2, "overwritten")
    p.add(4, 2, "skipped")
    p.add(9, 2, "later")
    mine, lost = p.applied([Entry(3, 3), Entry(3, 4), Entry(3, 5)])
    assert mine == [] and sorted(lost) == ["overwritten", "skipped"]
    assert len(p) == 1


def test_a_tail_overwritten_by_a_newer_leader_is_lost_at_once() -> None:
    log = _log(1, 2, 2, 2, 2)
    p: PendingProposals[int] = PendingProposals()
    for i in (3, 4, 5):
        p.add(i, 2, i)
    assert not p.may_be_lost(6, snapshot=False)  # the leader's own append
    # A leader of term 3 replaces index 3 on and ends the log at 4.
    log.append([Entry(3, 3), Entry(3, 4)])
    assert p.may_be_lost(3, snapshot=False)
    assert sorted(p.lost(log)) == [3, 4, 5]
    assert len(p) == 0


def test_entries_still_in_the_log_with_their_term_stay_pending() -> None:
    log = _log(1, 2, 2, 2)
    p: PendingProposals[int] = PendingProposals()
    p.add(3, 2, 3)
    p.add(4, 2, 4)
    log.append([Entry(2, 4), Entry(3, 5)])  # same entry at 4, a new one after
    assert p.lost(log) == []
    assert len(p) == 2


def test_a_snapshot_over_a_proposal_loses_it() -> None:
    log = _log(1, 2)
    p: PendingProposals[int] = PendingProposals()
    p.add(2, 2, 2)
    log.restore(Snapshot(SnapshotMeta(index=5, term=3)))
    assert p.may_be_lost(None, snapshot=True)
    assert p.lost(log) == [2]


def test_drain_hands_back_every_waiter_once() -> None:
    p: PendingProposals[int] = PendingProposals()
    p.add(1, 1, 1)
    p.add(2, 1, 2)
    assert sorted(p.drain()) == [1, 2]
    assert p.drain() == [] and not p.may_be_lost(1, snapshot=True)
