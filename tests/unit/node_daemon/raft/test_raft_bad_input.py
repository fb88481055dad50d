"""Whatever a peer sends, the core neither raises nor breaks its own
invariants: malformed messages are dropped and counted."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_daemon.raft import (
    ConfState,
    Entry,
    EntryType,
    Message,
    MessageType,
    RaftCore,
    Snapshot,
    SnapshotMeta,
)
from tests.unit.support.raftkit import Net, new_core, persist

pytestmark = pytest.mark.unit
MT = MessageType

small = st.integers(min_value=-2, max_value=12)
entries = st.lists(
    st.builds(
        Entry,
        term=small,
        index=small,
        type=st.sampled_from(EntryType),
        data=st.binary(max_size=8),
    ),
    max_size=4,
)
snapshots = st.one_of(
    st.none(),
    st.builds(
        Snapshot,
        meta=st.builds(
            SnapshotMeta,
            index=small,
            term=small,
            conf=st.just(ConfState(frozenset({1, 2, 3}))),
        ),
        data=st.binary(max_size=4),
    ),
)
messages = st.builds(
    Message,
    type=st.sampled_from(MT),
    to=st.sampled_from([1, 2, 3, 9]),
    frm=st.sampled_from([0, 1, 2, 3, 9]),
    term=small,
    log_term=small,
    index=small,
    entries=entries.map(tuple),
    commit=small,
    reject=st.booleans(),
    reject_hint=small,
    snapshot=snapshots,
    context=st.binary(max_size=3),
    force=st.booleans(),
    catching_up=st.booleans(),
    caught_up=small,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages, max_size=30), st.sampled_from(["follower", "leader"]))
def test_random_messages_never_crash_the_core(msgs: list[Message], role: str) -> None:
    net = Net([new_core(i, log_terms=[1, 1, 2], seed=i) for i in (1, 2, 3)])
    if role == "leader":
        net.elect(1)
    r = net.cores[1]
    for m in msgs:
        r.step(replace(m, to=1))
        persist(r)
        r.tick()
        persist(r)
        assert_log_is_sound(r)


def assert_log_is_sound(r: RaftCore) -> None:
    log = r.log
    assert log.applied <= log.committed <= log.last_index()
    ents = log.slice(log.first_index(), log.last_index() + 1)
    assert [e.index for e in ents] == list(range(log.first_index(), log.last_index() + 1))
    terms = [e.term for e in ents]
    assert terms == sorted(terms) and (not terms or terms[-1] <= r.term)


def test_malformed_append_is_dropped_and_counted() -> None:
    r = new_core(1, term=2)
    gap = Message(MT.APPEND, 1, 2, 2, 0, 0, (Entry(2, 1), Entry(2, 3)))
    future = Message(MT.APPEND, 1, 2, 2, 0, 0, (Entry(5, 1),))
    for m in (gap, future):
        r.step(m)
    assert r.invalid == 2
    assert r.log.last_index() == 0
    assert not persist(r)


def test_snapshot_message_without_a_snapshot_is_dropped() -> None:
    r = new_core(1, term=2)
    r.step(Message(MT.SNAPSHOT, 1, 2, 2))
    assert r.invalid == 1 and not persist(r)


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00\x01", b"\x00\x01\x00\x00", b"\x00\x01\x00\x01" + (2).to_bytes(8, "big") * 2],
    ids=["empty", "short", "fewer-ids-than-counted", "voter-and-learner"],
)
def test_an_append_with_a_configuration_that_does_not_decode_is_dropped(data: bytes) -> None:
    """Found by the test above (hypothesis): such an entry crashed the
    follower where it recorded configurations. Now the whole append is
    dropped and counted, and nothing of it is stored."""
    r = new_core(1, term=2)
    good = Entry(2, 1, EntryType.NORMAL, b"x")
    bad = Entry(2, 2, EntryType.CONFIG, data)
    r.step(Message(MT.APPEND, 1, 2, 2, 0, 0, (good, bad)))
    assert r.invalid == 1
    assert r.log.last_index() == 0 and not persist(r)
    ok = Entry(2, 2, EntryType.CONFIG, ConfState(frozenset({1, 2}), frozenset({3})).encode())
    r.step(Message(MT.APPEND, 1, 2, 2, 0, 0, (good, ok)))
    assert r.invalid == 1 and r.log.last_index() == 2
