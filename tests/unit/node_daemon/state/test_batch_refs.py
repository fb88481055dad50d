"""One copy per node: the state stores a replicated batch as a reference
into the Raft log entry that carried it, and the log keeps such entries past
its compaction point (docs/one-copy.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from node_daemon.raft import CompactedError, ConfState, Entry, EntryType, Snapshot, SnapshotMeta
from node_daemon.raft.errors import MissingEntryError
from node_daemon.state import batch_refs, batch_store
from node_daemon.state.machine import StateMachine, append_op
from node_daemon.storage.raft_log import LmdbLogStorage
from node_daemon.work.appends import prepare_appends
from roadlog import columnar
from roadlog.errors import Code, RoadlogError
from roadlog.partitioning import split_by_partition
from roadlog.protowire import length_delimited
from roadlog.v1 import client_pb2, command_pb2
from tests.unit.node_daemon.state.test_state_machine import T0, Log, pings
from tests.unit.node_daemon.work.test_appends import Replica, lookup, request

pytestmark = pytest.mark.unit

CONF = ConfState(frozenset({1}))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[StateMachine, LmdbLogStorage]]:
    log = LmdbLogStorage(tmp_path / "raft", map_size=64 << 20)
    sm = StateMachine(tmp_path / "state", map_size=64 << 20, entries=log)
    yield sm, log
    sm.close()
    log.close()


def stored_values(sm: StateMachine) -> list[bytes]:
    with sm.env.begin() as txn:
        return [bytes(v) for _, v in txn.cursor(db=sm.pings.batches)]


def fetch_all(sm: StateMachine, partitions: int = 4) -> list[bytes]:
    out = []
    for p in range(partitions):
        resp = sm.fetch(client_pb2.FetchRequest(topic="munich", partition=p, offset=0))
        out += [b.batch for b in resp.batches]
    return out


# ------------------------------------------------------------ the wire walk


def test_the_walk_finds_each_parts_batch_where_protobuf_reads_it() -> None:
    ops = [
        append_op("munich", split_by_partition(pings(40, devices=7), 4), 0, 0),
        command_pb2.Op(trim=command_pb2.TrimOp()),
        append_op("other", split_by_partition(pings(9, start=40), 4), 5, 2),
    ]
    data = command_pb2.Command(leader_ms=T0, ops=ops).SerializeToString()
    where = batch_refs.append_batch_spans(data)
    assert where is not None and len(where) == 3 and where[1] == []
    parsed = command_pb2.Command.FromString(data)
    for op, spans in zip(parsed.ops, where, strict=True):
        batches = [part.batch for part in op.append.parts]
        assert len(spans) == len(batches)
        for batch, (offset, length) in zip(batches, spans, strict=True):
            assert data[offset : offset + length] == batch


def test_the_walk_reads_repeated_fields_as_protobuf_merges_them() -> None:
    """Two ``append`` fields in one op merge (their parts concatenate), and
    a part's last ``batch`` field wins: the walk agrees."""
    a = command_pb2.AppendOp(topic="t", parts=[command_pb2.PartitionBatch(partition=0, batch=b"A")])
    b = command_pb2.AppendOp(parts=[command_pb2.PartitionBatch(partition=1, batch=b"BB")])
    part = command_pb2.PartitionBatch(partition=2, batch=b"first").SerializeToString()
    part += length_delimited(2, 4) + b"last"
    c = length_delimited(5, len(part)) + part  # AppendOp.parts with two batch fields
    op = (
        length_delimited(1, a.ByteSize())
        + a.SerializeToString()
        + length_delimited(1, b.ByteSize())
        + b.SerializeToString()
        + length_delimited(1, len(c))
        + c
    )
    data = length_delimited(2, len(op)) + op
    parsed = command_pb2.Command.FromString(data)
    assert [p.batch for p in parsed.ops[0].append.parts] == [b"A", b"BB", b"last"]
    where = batch_refs.append_batch_spans(data)
    assert where is not None
    assert [data[o : o + n] for o, n in where[0]] == [b"A", b"BB", b"last"]


@pytest.mark.parametrize("data", [b"\x12\x05ab", b"\x12", b"\x13", b"\x12\x02\x0a\x09"])
def test_a_malformed_command_has_no_spans(data: bytes) -> None:
    assert batch_refs.append_batch_spans(data) is None


# ------------------------------------------------------------ the state


def test_batches_are_stored_as_references_and_read_back_whole(
    node: tuple[StateMachine, LmdbLogStorage], tmp_path: Path
) -> None:
    sm, _ = node
    alone = StateMachine(tmp_path / "alone", map_size=64 << 20)
    try:
        for target in (sm, alone):
            log = Log(target)
            log.create()
            for k in range(5):
                log.append(pings(30, start=k * 30, devices=9), at_ms=T0 + k)
        values = stored_values(sm)
        assert values and all(
            len(v) == batch_store.HEADER.size + batch_refs.REF_SIZE for v in values
        )
        assert all(batch_refs.is_ref(v, batch_store.HEADER.size) for v in values)
        assert not any(batch_refs.is_ref(v, batch_store.HEADER.size) for v in stored_values(alone))
        assert fetch_all(sm) == fetch_all(alone)
        # The digest hashes the batches' bytes, however they are stored.
        assert sm.digest() == alone.digest()
    finally:
        alone.close()


def test_a_merge_with_a_retry_stores_the_new_rows_as_bytes(tmp_path: Path) -> None:
    """A merged op whose spans are not all stored (a retry among them) has
    its batches cut to the new rows: bytes no entry holds, so they are
    stored as bytes; ops stored whole are references."""
    r = Replica(tmp_path / "sm", logged=True)
    try:
        first = request([1, 2, 3, 4], producer=9, seq=1)
        [p1], _ = prepare_appends([first], lookup, T0)
        r.apply([p1.op])
        assert all(batch_refs.is_ref(v, batch_store.HEADER.size) for v in stored_values(r.sm))
        refs = len(stored_values(r.sm))
        again = request([11, 12], producer=9, seq=2)
        [p2], _ = prepare_appends([first, again], lookup, T0)
        r.apply([p2.op])
        values = stored_values(r.sm)
        assert len(values) > refs
        assert sum(batch_refs.is_ref(v, batch_store.HEADER.size) for v in values) == refs
        stored = sorted(t for q in range(4) for t in r.read(q))
        assert stored == [1, 2, 3, 4, 11, 12]
    finally:
        r.close()


def test_the_log_keeps_what_the_state_refers_to_past_compaction(
    node: tuple[StateMachine, LmdbLogStorage],
) -> None:
    sm, log = node
    feed = Log(sm)
    feed.create()
    for k in range(6):
        feed.append(pings(10, start=k * 10, devices=3), at_ms=T0 + k)
    oldest = sm.oldest_entry_ref()
    assert oldest == 2  # entry 1 created the topic; entry 2 is the first append
    before = fetch_all(sm)
    last = sm.applied_index
    log.compact(Snapshot(SnapshotMeta(last, 1, CONF), b"snap"), retain_from=oldest)
    assert log.first_index() == last + 1 and log.retained_from() == oldest
    with pytest.raises(CompactedError):
        log.entries(oldest, last + 1)
    assert fetch_all(sm) == before  # read from the entries kept
    assert log.verify() == 0
    # What is kept survives a restart of the log.
    log.close()
    again = LmdbLogStorage(log.path, map_size=64 << 20)
    sm.entries = again
    try:
        assert again.retained_from() == oldest and fetch_all(sm) == before
        # Compacting without keeping anything (older rules) leaves the state
        # with references the log cannot resolve: a read says so and stays up.
        again.save(None, [Entry(1, last + 1, EntryType.NORMAL, b"")])
        again.compact(Snapshot(SnapshotMeta(last + 1, 1, CONF), b"snap"))
        assert again.retained_from() == last + 2
        with pytest.raises(MissingEntryError):
            again.read_slice(oldest, 0, 1)
        with pytest.raises(RoadlogError) as err:
            fetch_all(sm)
        assert err.value.code == Code.UNAVAILABLE
    finally:
        sm.entries = None
        again.close()


def test_what_the_log_keeps_never_grows_back(tmp_path: Path) -> None:
    log = LmdbLogStorage(tmp_path / "raft", map_size=64 << 20)
    try:
        log.save(None, [Entry(1, i, EntryType.NORMAL, bytes([i]) * 10) for i in range(1, 21)])
        log.compact(Snapshot(SnapshotMeta(10, 1, CONF), b""), retain_from=5)
        assert log.retained_from() == 5 and log.read_slice(5, 2, 3) == bytes([5]) * 3
        log.compact(Snapshot(SnapshotMeta(15, 1, CONF), b""), retain_from=3)  # asks for less
        assert log.retained_from() == 5  # entries 3 and 4 are gone for good
        log.compact(Snapshot(SnapshotMeta(18, 1, CONF), b""), retain_from=12)
        assert log.retained_from() == 12
        with pytest.raises(MissingEntryError):
            log.read_slice(11, 0, 1)
        with pytest.raises(MissingEntryError):
            log.read_slice(12, 5, 10)  # past the entry's end
        assert log.read_slice(19, 0, 10) == bytes([19]) * 10
        # A snapshot installed from a leader replaces the whole log.
        log.save(None, [], Snapshot(SnapshotMeta(30, 2, CONF), b"from the leader"))
        assert log.retained_from() == 31 and log.first_index() == 31
    finally:
        log.close()


def test_retention_moves_the_oldest_reference_and_compaction_lets_entries_go(
    node: tuple[StateMachine, LmdbLogStorage],
) -> None:
    sm, log = node
    feed = Log(sm)
    feed.create(retention_ms=60_000)
    for k in range(5):
        feed.append(pings(10, start=k * 10, devices=1), at_ms=T0 + k * 30_000)
    first_append = 2
    assert sm.oldest_entry_ref() == first_append
    trim = command_pb2.Command(
        leader_ms=T0 + 150_000, ops=[command_pb2.Op(trim=command_pb2.TrimOp())]
    )
    feed.run(trim)
    # Batches older than 60 s at 150 s are gone: those of entries 2..4.
    oldest = sm.oldest_entry_ref()
    assert oldest == first_append + 3
    log.compact(Snapshot(SnapshotMeta(sm.applied_index, 1, CONF), b""), retain_from=oldest)
    assert log.retained_from() == oldest
    with pytest.raises(MissingEntryError):
        log.read_slice(first_append, 0, 1)
    kept = fetch_all(sm)
    assert sum(len(columnar.decode(b).ts_ms) for b in kept) == 20
