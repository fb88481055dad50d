"""Batches stored in pieces of a page (``batch_store``): every length reads
back whole, no value outgrows one overflow page, trims and topic deletes
take every piece, a state that stored batches whole (format 1) reads and
digests as the same, and a state of a newer format is refused."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest

from node_daemon.raft import Entry, EntryType
from node_daemon.state import batch_store
from node_daemon.state.batch_store import FIRST_FULL, HEADER, PIECE
from node_daemon.state.format import STATE_FORMAT, StateFormatError
from node_daemon.state.machine import StateMachine, append_op
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.geo import bbox_region
from roadlog.partitioning import split_by_partition
from roadlog.v1 import client_pb2, command_pb2, topics_pb2
from tests.unit.node_daemon.state.machine_reference import ReferenceStateMachine

pytestmark = pytest.mark.unit

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson
T0 = 1_800_000_000_000
FIRST = PIECE - HEADER.size  # batch bytes in the ``batches`` value


@pytest.fixture
def env(tmp_path: Path) -> Iterator[lmdb.Environment]:
    e = lmdb.open(str(tmp_path / "raw"), map_size=64 << 20, max_dbs=4)
    yield e
    e.close()


LENGTHS = [1, FIRST - 1, FIRST, FIRST + 1, FIRST + PIECE, FIRST + PIECE + 1, 50_000]


def test_every_length_reads_back_whole_and_no_value_outgrows_a_page(
    env: lmdb.Environment,
) -> None:
    batches, more = env.open_db(b"batches"), env.open_db(b"batchmore")
    sent = {}
    with env.begin(write=True) as txn:
        for base, n in enumerate(LENGTHS):  # neighbours: one batch's pieces are its own
            sent[base] = os.urandom(n)
            key = struct.pack(">IIQ", 1, 0, base)
            batch_store.put_batch(txn, batches, more, key, n, T0 + base, sent[base])
    with env.begin() as txn:
        values = [v for _, v in txn.cursor(db=batches)] + [v for _, v in txn.cursor(db=more)]
        assert max(len(v) for v in values) == PIECE  # one overflow page each
        pieces = txn.stat(more)["entries"]
        assert pieces == sum(max(0, -(-(n - FIRST) // PIECE)) for n in LENGTHS)
        for base, n in enumerate(LENGTHS):
            key = struct.pack(">IIQ", 1, 0, base)
            value = txn.get(key, db=batches)
            assert value is not None
            assert HEADER.unpack_from(value) == (n, T0 + base)
            assert batch_store.batch_bytes(txn, more, key, value) == sent[base]
            whole = batch_store.whole_value(txn, more, key, value)
            assert whole == HEADER.pack(n, T0 + base) + sent[base]
    with env.begin(write=True) as txn:  # delete every other batch: the rest stay whole
        for base in range(0, len(LENGTHS), 2):
            key = struct.pack(">IIQ", 1, 0, base)
            raw = batch_store.delete_batch(txn, batches, more, key)
            assert raw is not None and HEADER.unpack_from(raw)[0] == LENGTHS[base]
        assert batch_store.delete_batch(txn, batches, more, struct.pack(">IIQ", 1, 0, 0)) is None
    with env.begin() as txn:
        for base in range(len(LENGTHS)):
            key = struct.pack(">IIQ", 1, 0, base)
            value = txn.get(key, db=batches)
            if base % 2 == 0:
                assert value is None
            else:
                assert value is not None
                assert batch_store.batch_bytes(txn, more, key, value) == sent[base]
        left = sum(max(0, -(-(LENGTHS[b] - FIRST) // PIECE)) for b in range(1, len(LENGTHS), 2))
        assert txn.stat(more)["entries"] == left


def test_a_value_stored_whole_before_pieces_reads_as_it_is(env: lmdb.Environment) -> None:
    """Format 1 stored header + batch as one value, longer than a page."""
    batches = env.open_db(b"batches")
    data = os.urandom(3 * PIECE)
    key = struct.pack(">IIQ", 1, 0, 0)
    with env.begin(write=True) as txn:
        txn.put(key, HEADER.pack(7, T0) + data, db=batches)
    with env.begin() as txn:
        value = txn.get(key, db=batches)
        assert value is not None and len(value) > FIRST_FULL
        assert batch_store.batch_bytes(txn, None, key, value) == data


def big_pings(n: int, seed: int) -> PingColumns:
    rng = np.random.default_rng(seed)
    return PingColumns.from_columns(
        [f"vehicle-{d:06d}" for d in rng.integers(0, 100_000, n)],
        list(T0 + np.arange(n)),
        list(rng.uniform(48.06, 48.24, n)),
        list(rng.uniform(11.41, 11.74, n)),
        speed_mps=list(rng.uniform(0, 30, n)),
    )


def commands(retention_ms: int = 0) -> list[bytes]:
    """Create a topic of 2 partitions, then append 3 batches of 3000 pings
    (each partition's part well over a page) a minute apart."""
    spec = topics_pb2.TopicSpec(
        name="munich", region_geojson=REGION, partitions=2, retention_ms=retention_ms
    )
    out = [
        command_pb2.Command(
            leader_ms=T0, ops=[command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))]
        )
    ]
    for k in range(3):
        op = append_op("munich", split_by_partition(big_pings(3000, k), 2), 0, 0)
        out.append(command_pb2.Command(leader_ms=T0 + k * 60_000, ops=[op]))
    return [c.SerializeToString() for c in out]


def apply_all(sm: StateMachine, cmds: list[bytes]) -> None:
    start = sm.applied_index
    for i, raw in enumerate(cmds, start=start + 1):
        sm.apply([Entry(1, i, EntryType.NORMAL, raw)])


def fetched(sm: StateMachine, partition: int) -> list[bytes]:
    resp = sm.fetch(client_pb2.FetchRequest(topic="munich", partition=partition, max_pings=10**6))
    return [b.batch for b in resp.batches]


def longest_value(sm: StateMachine, name: bytes) -> int:
    db = sm.env.open_db(name, create=False)
    with sm.env.begin() as txn:
        return max((len(v) for _, v in txn.cursor(db=db)), default=0)


def pieces(sm: StateMachine) -> int:
    db = sm.env.open_db(b"batchmore", create=False)
    with sm.env.begin() as txn:
        return int(txn.stat(db)["entries"])


def test_the_state_stores_big_batches_in_pieces_and_hands_out_the_bytes_appended(
    tmp_path: Path,
) -> None:
    sm = StateMachine(tmp_path / "sm", map_size=256 << 20)
    cmds = commands()
    apply_all(sm, cmds)
    assert longest_value(sm, b"batches") == PIECE and pieces(sm) > 6
    for p in range(2):
        expect = [
            part.batch
            for raw in cmds[1:]
            for part in command_pb2.Command.FromString(raw).ops[0].append.parts
            if part.partition == p
        ]
        assert fetched(sm, p) == expect and len(expect[0]) > 2 * PIECE
    # a fetch from the middle of a batch in pieces cuts it right
    resp = sm.fetch(client_pb2.FetchRequest(topic="munich", partition=0, offset=5, max_pings=1))
    whole = columnar.decode(fetched(sm, 0)[0])
    assert columnar.decode(resp.batches[0].batch).ts_ms.tolist() == whole.ts_ms[5:].tolist()
    sm.close()


def test_a_state_that_stored_batches_whole_reads_and_digests_as_one_in_pieces(
    tmp_path: Path,
) -> None:
    """The reference machine stores each batch as one value (format 1)."""
    old = ReferenceStateMachine(tmp_path / "old", map_size=256 << 20)
    new = StateMachine(tmp_path / "new", map_size=256 << 20)
    cmds = commands()
    apply_all(old, cmds)
    apply_all(new, cmds)
    assert longest_value(old, b"batches") > PIECE and pieces(old) == 0
    assert pieces(new) > 0
    assert old.digest() == new.digest()
    for p in range(2):
        assert fetched(old, p) == fetched(new, p)
    new.close()
    old.close()


def test_retention_and_topic_deletes_take_every_piece(tmp_path: Path) -> None:
    sm = StateMachine(tmp_path / "sm", map_size=256 << 20)
    apply_all(sm, commands(retention_ms=90_000))
    before = pieces(sm)
    # at the last append's time + 60 s, the first two batches are past 90 s
    trim = command_pb2.Command(
        leader_ms=T0 + 180_000, ops=[command_pb2.Op(trim=command_pb2.TrimOp())]
    )
    apply_all(sm, [trim.SerializeToString()])
    assert 0 < pieces(sm) < before
    assert all(d.first_offset > 0 for d in sm.describe("munich").partitions)
    assert [len(fetched(sm, p)) for p in range(2)] == [1, 1]
    delete = command_pb2.Command(
        ops=[command_pb2.Op(delete_topic=command_pb2.DeleteTopicOp(name="munich"))]
    )
    apply_all(sm, [delete.SerializeToString()])
    assert pieces(sm) == 0 and longest_value(sm, b"batches") == 0
    sm.close()


def test_a_state_of_a_newer_format_is_refused_not_misread(tmp_path: Path) -> None:
    sm = StateMachine(tmp_path / "sm", map_size=64 << 20)
    apply_all(sm, commands()[:2])
    digest = sm.digest()
    with sm.env.begin(write=True) as txn:
        txn.put(b"state_format", struct.pack(">Q", STATE_FORMAT + 1), db=sm.meta)
    assert sm.digest() == digest  # the format is the replica's own, not replicated state
    sm.close()
    with pytest.raises(StateFormatError, match="newer release"):
        StateMachine(tmp_path / "sm", map_size=64 << 20)
    with pytest.raises(StateFormatError):
        StateMachine(tmp_path / "sm", map_size=64 << 20, readonly=True)


def test_a_snapshot_of_a_newer_format_is_refused_and_the_state_kept(tmp_path: Path) -> None:
    leader = StateMachine(tmp_path / "leader", map_size=64 << 20)
    apply_all(leader, commands())
    with leader.env.begin(write=True) as txn:
        txn.put(b"state_format", struct.pack(">Q", STATE_FORMAT + 1), db=leader.meta)
    leader.write_snapshot(tmp_path / "snap")
    leader.close()
    follower = StateMachine(tmp_path / "follower", map_size=64 << 20)
    apply_all(follower, commands()[:2])
    before = (follower.applied_index, follower.digest())
    with pytest.raises(StateFormatError, match="newer release"):
        follower.install_snapshot(tmp_path / "snap")
    assert (follower.applied_index, follower.digest()) == before
    assert not (tmp_path / "follower.incoming").exists()
    assert len(fetched(follower, 0)) == 1
    follower.close()


def test_a_read_only_view_reads_batches_in_pieces_from_its_first_read(tmp_path: Path) -> None:
    """As the main process reads a worker's replica (``replica_view``): a
    transaction cannot use a database opened after it began, so the view
    opens ``batchmore`` before its reads, never inside one."""
    writer = StateMachine(tmp_path / "sm", map_size=256 << 20)
    cmds = commands()
    apply_all(writer, cmds)
    want = [fetched(writer, p) for p in range(2)]
    digest = writer.digest()
    writer.close()
    view = StateMachine(tmp_path / "sm", map_size=256 << 20, readonly=True)
    assert [fetched(view, p) for p in range(2)] == want and view.digest() == digest
    view.close()


def test_a_transaction_that_began_before_the_pieces_were_opened_says_so(
    env: lmdb.Environment,
) -> None:
    batches = env.open_db(b"batches")
    key = struct.pack(">IIQ", 1, 0, 0)
    data = os.urandom(2 * PIECE)
    with env.begin(write=True) as txn:  # a batch that fills its first value exactly
        txn.put(key, HEADER.pack(1, T0) + data[:FIRST], db=batches)
    with env.begin() as txn:  # no ``batchmore`` at all: the value is the whole batch
        value = txn.get(key, db=batches)
        assert value is not None
        assert batch_store.batch_bytes(txn, None, key, value) == data[:FIRST]
    more = env.open_db(batch_store.MORE_NAME)
    with env.begin(write=True) as txn:
        batch_store.put_batch(txn, batches, more, key, len(data), T0, data)
    with env.begin() as txn:  # it exists, but was not opened for this transaction
        value = txn.get(key, db=batches)
        assert value is not None
        with pytest.raises(batch_store.PiecesNotOpen):
            batch_store.batch_bytes(txn, None, key, value)
        assert batch_store.batch_bytes(txn, more, key, value) == data
