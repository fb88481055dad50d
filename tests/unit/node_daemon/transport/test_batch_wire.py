"""A RaftBatch encoded in parts (entries' data left as they are) parses to
the very batch protobuf builds, for any messages; and the parts hold each
entry's data as the Entry's own bytes object (no copy)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_daemon.raft import ConfState, Entry, EntryType, Message, MessageType, Snapshot
from node_daemon.raft.types import SnapshotMeta
from node_daemon.transport.batch_wire import encode_batch
from node_daemon.transport.wire import message_to_pb
from roadlog.protowire import varint
from roadlog.v1 import raft_pb2

pytestmark = pytest.mark.unit

u64 = st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1))
entries = st.lists(
    st.builds(
        Entry,
        term=u64,
        index=u64,
        type=st.sampled_from(EntryType),
        # small, and big enough for a 3-byte length (made cheaply)
        data=st.one_of(
            st.binary(max_size=200), st.integers(16_384, 20_000).map(lambda n: b"z" * n)
        ),
    ),
    max_size=4,
)
messages = st.builds(
    Message,
    type=st.sampled_from(MessageType),
    to=u64,
    frm=u64,
    term=u64,
    log_term=u64,
    index=u64,
    entries=entries.map(tuple),
    commit=u64,
    reject=st.booleans(),
    reject_hint=u64,
    snapshot=st.one_of(
        st.none(),
        st.just(Snapshot(SnapshotMeta(7, 2, ConfState(frozenset({1, 2, 3}))), b"")),
    ),
    context=st.binary(max_size=3),
    force=st.booleans(),
    catching_up=st.booleans(),
    # (a flag, or an index: whatever the message type declares)
    caught_up=st.booleans() if Message.__dataclass_fields__["caught_up"].type == "bool" else u64,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.text(max_size=20),
    u64,
    st.lists(st.tuples(st.integers(0, 64), messages), max_size=6),
)
def test_the_parts_parse_to_the_batch_protobuf_builds(
    cluster: str, node_id: int, msgs: list[tuple[int, Message]]
) -> None:
    want = raft_pb2.RaftBatch(cluster=cluster, messages=[message_to_pb(m, g) for g, m in msgs])
    setattr(want, "from", node_id)
    got = raft_pb2.RaftBatch.FromString(b"".join(encode_batch(cluster, node_id, msgs)))
    assert got == want


def test_entry_data_travels_as_the_entries_own_bytes() -> None:
    data = [b"x" * 100_000, b"y" * 300]
    m = Message(
        MessageType.APPEND,
        2,
        1,
        term=3,
        entries=(Entry(3, 10, data=data[0]), Entry(3, 11, data=data[1]), Entry(3, 12)),
    )
    parts = encode_batch("c", 1, [(0, m), (3, m)])
    assert sum(1 for p in parts if p is data[0]) == 2  # once per message, never copied
    assert sum(1 for p in parts if p is data[1]) == 2


def test_varints() -> None:
    assert [varint(n) for n in (0, 1, 127, 128, 300, 2**64 - 1)] == [
        b"\x00",
        b"\x01",
        b"\x7f",
        b"\x80\x01",
        b"\xac\x02",
        b"\xff" * 9 + b"\x01",
    ]


@given(
    st.one_of(
        st.sampled_from([2**k + d for k in (7, 14, 21, 28, 35, 63) for d in (-1, 0, 1)]),
        st.integers(0, 2**64 - 1),
    )
)
def test_varints_are_protobufs_at_every_length(n: int) -> None:
    # Field 1 of a message, uint64: its tag (one byte), then the varint.
    written = raft_pb2.RaftEntry(term=n).SerializeToString()
    assert varint(n) == (written[1:] if n else b"\x00")
