"""The leader's bookkeeping: in-flight windows, follower progress states,
majority arithmetic and single-server configuration changes."""

from __future__ import annotations

import pytest

from node_daemon.raft import ConfChange, ConfChangeType, ConfState
from node_daemon.raft.confchange import apply_change
from node_daemon.raft.progress import Inflights, Progress, ProgressState
from node_daemon.raft.quorum import VoteResult, committed_index, vote_result

pytestmark = pytest.mark.unit


def test_inflights_bound_count_and_bytes() -> None:
    f = Inflights(max_count=3, max_bytes=100)
    f.add(5, 10)
    f.add(7, 10)
    assert not f.full()
    f.add(9, 10)
    assert f.full() and len(f) == 3
    f.free_le(7)
    assert len(f) == 1 and f.bytes == 10 and not f.full()
    f.add(12, 95)
    assert f.full()  # by bytes
    f.free_first()
    assert f.bytes == 95


def test_progress_probe_sends_one_at_a_time() -> None:
    p = Progress(next_index=11, max_inflight=8, max_inflight_bytes=1 << 20, is_learner=False)
    assert p.state == ProgressState.PROBE and not p.is_paused()
    p.sent_entries(12, 10)
    assert p.is_paused()
    assert p.maybe_update(12)
    p.become_replicate()
    assert p.next == 13 and not p.is_paused()


def test_progress_replicate_advances_next_optimistically() -> None:
    p = Progress(next_index=1, max_inflight=2, max_inflight_bytes=1 << 20, is_learner=False)
    p.become_replicate()
    p.sent_entries(5, 1)
    p.sent_entries(9, 1)
    assert p.next == 10 and p.is_paused()
    assert p.maybe_update(5)
    p.inflights.free_le(5)
    assert not p.is_paused()


def test_progress_rejection_in_replicate_falls_back_to_match() -> None:
    p = Progress(next_index=1, max_inflight=8, max_inflight_bytes=1 << 20, is_learner=False)
    p.maybe_update(4)
    p.become_replicate()
    p.sent_entries(10, 1)
    assert not p.maybe_decr_to(3, 0)  # stale: at or below match
    assert p.maybe_decr_to(8, 0)
    assert p.next == 5


def test_progress_probe_uses_the_hint() -> None:
    p = Progress(next_index=20, max_inflight=8, max_inflight_bytes=1 << 20, is_learner=False)
    assert not p.maybe_decr_to(7, 3)  # not the probe we sent
    assert p.maybe_decr_to(19, 6)
    assert p.next == 7


def test_progress_after_snapshot_probes_past_it() -> None:
    p = Progress(next_index=1, max_inflight=8, max_inflight_bytes=1 << 20, is_learner=False)
    p.become_snapshot(50)
    assert p.is_paused()
    p.become_probe()
    assert p.next == 51


@pytest.mark.parametrize(
    ("voters", "match", "want"),
    [
        ({1}, {1: 5}, 5),
        ({1, 2, 3}, {1: 5, 2: 3, 3: 1}, 3),
        ({1, 2, 3}, {1: 5}, 0),
        ({1, 2, 3, 4}, {1: 9, 2: 8, 3: 2, 4: 1}, 2),
        ({1, 2, 3, 4, 5}, {1: 9, 2: 8, 3: 7, 4: 1, 5: 1}, 7),
        (set(), {}, 0),
    ],
)
def test_committed_index_is_the_majority_match(
    voters: set[int], match: dict[int, int], want: int
) -> None:
    assert committed_index(voters, match) == want


def test_vote_result() -> None:
    v = frozenset({1, 2, 3, 4, 5})
    assert vote_result(v, {1: True, 2: True}) == VoteResult.PENDING
    assert vote_result(v, {1: True, 2: True, 3: True}) == VoteResult.WON
    assert vote_result(v, {1: True, 2: False, 3: False, 4: False}) == VoteResult.LOST
    assert vote_result(v, {9: True, 8: True, 7: True}) == VoteResult.PENDING  # not voters


def test_changes_move_one_voter_at_a_time() -> None:
    c = ConfState(frozenset({1, 2, 3}))
    c = apply_change(c, ConfChange(ConfChangeType.ADD_LEARNER, 4))
    assert c.learners == {4} and c.voters == {1, 2, 3}
    c = apply_change(c, ConfChange(ConfChangeType.ADD_VOTER, 4))
    assert c.voters == {1, 2, 3, 4} and not c.learners
    c = apply_change(c, ConfChange(ConfChangeType.REMOVE_NODE, 1))
    assert c.voters == {2, 3, 4}
    with pytest.raises(ValueError, match="last voter"):
        apply_change(ConfState(frozenset({1})), ConfChange(ConfChangeType.REMOVE_NODE, 1))
    with pytest.raises(ValueError, match="is a voter"):
        apply_change(c, ConfChange(ConfChangeType.ADD_LEARNER, 2))


def test_conf_state_round_trips_and_rejects_overlap() -> None:
    c = ConfState(frozenset({3, 1}), frozenset({7}))
    assert ConfState.decode(c.encode()) == c
    with pytest.raises(ValueError):
        ConfState(frozenset({1}), frozenset({1}))


def test_a_rejection_at_match_from_a_follower_that_lost_its_log_starts_over() -> None:
    p = Progress(next_index=1, max_inflight=8, max_inflight_bytes=1 << 20, is_learner=False)
    p.maybe_update(9)
    p.become_replicate()
    assert p.maybe_decr_to(9, 0, lost_log=True)  # it says it is catching up
    assert p.match == 0 and p.next == 1


def test_a_rejection_at_match_from_any_other_follower_is_stale() -> None:
    """Appends at 9 and 10 sent; the follower rejects 10 (it lacks 9 yet),
    then takes 9 and acknowledges it; the rejection arrives after the
    acknowledgement. Starting over from 0 for it re-sent the whole log
    (the simulation's seed 4264 never converged)."""
    p = Progress(next_index=1, max_inflight=8, max_inflight_bytes=1 << 20, is_learner=False)
    p.maybe_update(9)
    p.become_replicate()
    p.sent_entries(12, 1)
    assert not p.maybe_decr_to(9, 8)
    assert p.match == 9 and p.next == 13
