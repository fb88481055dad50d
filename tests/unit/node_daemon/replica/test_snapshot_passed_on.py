"""A snapshot received from a leader can be passed on (nemesis finding 18).

A node that installed a snapshot pulled from an earlier leader keeps it as
``recv-<index>-<term>.mdb``, the file its log names. Once that node led and
a follower needed the snapshot, the transport looked only for the
``snap-<index>-<term>.mdb`` files a node takes itself, answered "no such
snapshot here any more", and Raft sent the same snapshot again: the follower
pulled every 100 ms for 10 minutes and never caught up."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from node_daemon.raft import ConfState, HardState, Snapshot, SnapshotMeta
from node_daemon.replica.snapshots import Snapshots
from node_daemon.state.machine import StateMachine
from node_daemon.storage.raft_log import LmdbLogStorage

pytestmark = pytest.mark.unit


def _snapshots(tmp_path: Path) -> tuple[Snapshots, LmdbLogStorage, StateMachine]:
    log_store = LmdbLogStorage(tmp_path / "raft", map_size=4 << 20)
    sm = StateMachine(tmp_path / "state")
    snaps = Snapshots(
        tmp_path / "snapshots",
        log_store,
        sm,
        meta_at=lambda i: SnapshotMeta(i, 1, ConfState(voters=frozenset({1, 2, 3}))),
        log_io=ThreadPoolExecutor(1),
        wakeup=lambda: None,
        max_entries=1000,
        max_bytes=1 << 20,
    )
    return snaps, log_store, sm


def test_a_received_snapshot_is_served_as_the_one_the_log_names(tmp_path: Path) -> None:
    snaps, log_store, sm = _snapshots(tmp_path)
    try:
        # Received from the leader of term 3 as the transport stores it, and
        # installed: the log now names that file.
        received = snaps.directory / "recv-56107-3.mdb"
        sm.write_snapshot(received)
        meta = SnapshotMeta(56107, 3, ConfState(voters=frozenset({1, 2, 3})))
        log_store.save(
            HardState(term=4, vote=2, commit=56107), [], Snapshot(meta, str(received).encode())
        )

        assert snaps.file(56107, 3) == received
        # Only that snapshot: another index or term is not here.
        assert snaps.file(56107, 2) is None
        assert snaps.file(56000, 3) is None
        # Gone from the disk, it is not served.
        received.unlink()
        assert snaps.file(56107, 3) is None
    finally:
        sm.close()
        log_store.close()


def test_a_snapshot_this_node_took_is_served(tmp_path: Path) -> None:
    snaps, log_store, sm = _snapshots(tmp_path)
    try:
        taken = snaps.path(10, 2)
        sm.write_snapshot(taken)
        assert snaps.file(10, 2) == taken
        assert snaps.file(11, 2) is None
    finally:
        sm.close()
        log_store.close()
