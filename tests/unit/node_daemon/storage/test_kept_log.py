"""A state snapshot travels with the log entries its batches refer to
(``kept_log``): bundled from a log, taken into another log as it saves the
snapshot, and installed into a state without them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from node_daemon.raft import ConfState, Entry, EntryType, HardState, Snapshot, SnapshotMeta
from node_daemon.raft.errors import MissingEntryError
from node_daemon.state.machine import StateMachine
from node_daemon.state.pings import oldest_ref_in_snapshot
from node_daemon.storage import kept_log
from node_daemon.storage.raft_log import LmdbLogStorage, LogReader
from tests.unit.node_daemon.state.test_batch_refs import fetch_all
from tests.unit.node_daemon.state.test_state_machine import T0, Log, pings

pytestmark = pytest.mark.unit

CONF = ConfState(frozenset({1}))


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[tuple[StateMachine, LmdbLogStorage, Path]]:
    """A state with batches referring into its log, compacted past them, and
    a snapshot file of the state at its applied index."""
    log = LmdbLogStorage(tmp_path / "raft", map_size=64 << 20)
    sm = StateMachine(tmp_path / "state", map_size=64 << 20, entries=log)
    feed = Log(sm)
    feed.create()
    for k in range(6):
        feed.append(pings(25, start=k * 25, devices=4), at_ms=T0 + k)
    snap = tmp_path / "snap.mdb"
    index, term = sm.write_snapshot(snap)
    oldest = sm.oldest_entry_ref()
    assert oldest is not None and index == sm.applied_index
    log.compact(Snapshot(SnapshotMeta(index, term, CONF), str(snap).encode()), oldest)
    yield sm, log, snap
    sm.close()
    log.close()


@pytest.mark.parametrize("txn_bytes", [kept_log.TXN_BYTES, 1], ids=["one-txn", "txn-per-entry"])
def test_a_bundled_snapshot_makes_a_follower_whole(
    leader: tuple[StateMachine, LmdbLogStorage, Path],
    tmp_path: Path,
    txn_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kept_log, "TXN_BYTES", txn_bytes)  # bounded memory: many transactions
    sm, log, snap = leader
    index = sm.applied_index
    assert oldest_ref_in_snapshot(snap) == log.retained_from()
    ship = tmp_path / "ship.mdb"
    log.bundle(snap, ship, index)
    assert kept_log.kept_range(ship) == (log.retained_from(), index)
    assert kept_log.kept_range(snap) is None
    # The follower: its log takes the entries as it saves the snapshot, its
    # state is installed from the same file.
    flog = LmdbLogStorage(tmp_path / "f-raft", map_size=64 << 20)
    fsm = StateMachine(tmp_path / "f-state", map_size=64 << 20, entries=flog)
    try:
        meta = SnapshotMeta(index, 1, CONF)
        flog.save(HardState(term=1, commit=index), [], Snapshot(meta, str(ship).encode()))
        assert flog.retained_from() == log.retained_from() and flog.first_index() == index + 1
        fsm.install_snapshot(ship)
        assert fsm.applied_index == index
        assert fetch_all(fsm) == fetch_all(sm)
        assert fsm.digest() == sm.digest()
        # Installed without the entries: the state is its own size.
        assert fsm.size_bytes() < ship.stat().st_size
        with fsm.env.begin() as txn:
            assert txn.get(kept_log.KEPT_DB) is None
        # A follower that passes the snapshot on sends it as it got it.
        assert flog.verify() == 0
    finally:
        fsm.close()
        flog.close()


def test_a_bundle_of_entries_the_log_no_longer_keeps_is_refused(
    leader: tuple[StateMachine, LmdbLogStorage, Path], tmp_path: Path
) -> None:
    sm, log, snap = leader
    ship = tmp_path / "ship.mdb"
    lo = log.retained_from()
    with pytest.raises(MissingEntryError):
        kept_log.bundle(snap, ship, log.env, log._log, lo - 1, sm.applied_index)
    assert not ship.exists() and not ship.with_name(ship.name + ".tmp").exists()


def test_entries_carry_over_to_a_state_made_from_a_bundle(
    leader: tuple[StateMachine, LmdbLogStorage, Path], tmp_path: Path
) -> None:
    """What a restore does: the state it installs (and changes) becomes the
    snapshot, with the entries the backup carried."""
    sm, log, snap = leader
    ship = tmp_path / "ship.mdb"
    log.bundle(snap, ship, sm.applied_index)
    plain = tmp_path / "plain.mdb"
    plain.write_bytes(snap.read_bytes())
    assert not kept_log.carry_over(snap, plain)  # nothing to carry
    assert kept_log.carry_over(ship, plain)
    assert kept_log.kept_range(plain) == kept_log.kept_range(ship)


def test_another_process_reads_the_log_read_only(tmp_path: Path) -> None:
    log = LmdbLogStorage(tmp_path / "raft", map_size=64 << 20)
    log.save(None, [Entry(1, i, EntryType.NORMAL, bytes([i]) * 100) for i in range(1, 11)])
    log.compact(Snapshot(SnapshotMeta(8, 1, CONF), b""), retain_from=4)
    log.close()  # one opener of an environment per process: the writer is gone
    reader = LogReader(tmp_path / "raft")
    try:
        assert reader.read_slice(4, 3, 40) == bytes([4]) * 40
        assert reader.read_slice(10, 0, 100) == bytes([10]) * 100
        with pytest.raises(MissingEntryError):
            reader.read_slice(3, 0, 1)  # let go at the compaction
        with pytest.raises(MissingEntryError):
            reader.read_slice(4, 0, 101)  # past the entry's end
    finally:
        reader.close()
    with pytest.raises(MissingEntryError):
        LogReader(tmp_path / "none").read_slice(1, 0, 1)


def test_the_reader_opens_a_log_made_anew_under_its_path(tmp_path: Path) -> None:
    """A damaged log is set aside and an empty one made at the same path;
    a reader in another process then reads the new one, not the old."""
    path = tmp_path / "raft"
    log = LmdbLogStorage(path, map_size=64 << 20)
    log.save(None, [Entry(1, i, EntryType.NORMAL, b"old" * 10) for i in range(1, 4)])
    log.close()
    reader = LogReader(path)
    try:
        assert reader.read_slice(2, 0, 3) == b"old"
        path.rename(tmp_path / "corrupt-raft")
        log = LmdbLogStorage(path, map_size=64 << 20)
        log.save(None, [Entry(1, i, EntryType.NORMAL, b"new" * 10) for i in range(1, 3)])
        log.close()
        assert reader.read_slice(2, 0, 3) == b"new"
        with pytest.raises(MissingEntryError):
            reader.read_slice(3, 0, 3)  # only in the old one
    finally:
        reader.close()


def test_a_changed_byte_in_an_entry_kept_for_the_state_is_caught(
    leader: tuple[StateMachine, LmdbLogStorage, Path],
) -> None:
    """The entries kept below the snapshot hold the state's batches: a byte
    changed there is corruption (the group is set aside and caught up), not
    a ping read back wrong."""
    _, log, _ = leader
    kept = log.retained_from()
    assert kept < log.first_index()  # entries are kept below the snapshot
    assert log.verify() == 0
    key = kept.to_bytes(8, "big")
    with log.env.begin(write=True, db=log._log) as txn:
        raw = bytes(txn.get(key) or b"")
        txn.put(key, raw[:-1] + bytes([raw[-1] ^ 0x01]))
    assert log.verify() == kept
