"""A disk that fills in the middle of an LMDB commit (found by the nemesis,
issue 21): LMDB reports a write that stored fewer bytes than asked as EIO,
not ENOSPC ("mdb_txn_commit: Input/output error"), which is what a
filling disk does to a transaction bigger than the room left. The node
took that for a broken disk and stopped; it must be the same "disk full"
(``StorageFullError``: retried until space returns) as an ENOSPC, with
nothing of the failed transaction stored. Real tmpfs, no simulation."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_daemon.raft import Entry, HardState, StorageFullError
from node_daemon.state.machine import StateMachine
from node_daemon.storage.raft_log import LmdbLogStorage
from roadlog.v1 import command_pb2
from tests.conftest import small_tmpfs

pytestmark = pytest.mark.unit


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "small", "4m", "this test") as mnt:
        yield mnt


def leave_free(mnt: Path, pages: int) -> Path:
    """Ballast that leaves ``pages`` 4 KiB pages free: the next big commit
    is a short write."""
    st = os.statvfs(mnt)
    ballast = mnt / "ballast"
    with open(ballast, "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - pages * 4096))
    return ballast


def test_a_log_write_cut_short_by_a_full_disk_is_disk_full(small_disk: Path) -> None:
    s = LmdbLogStorage(small_disk / "log", map_size=64 << 20)
    first = [Entry(1, i, data=b"x" * 100) for i in range(1, 11)]
    s.save(HardState(1, 1, 0), first)
    ballast = leave_free(small_disk, 3)
    big = [Entry(1, i, data=os.urandom(2000)) for i in range(11, 111)]  # ~200 KB
    with pytest.raises(StorageFullError, match="disk full"):
        s.save(HardState(1, 1, 10), big)
    assert s.last_index() == 10  # nothing of it stored
    ballast.unlink()
    s.save(HardState(1, 1, 10), big)  # room again: the same write goes through
    assert s.entries(1, 111) == first + big
    s.close()


def _producers(index: int, n: int = 200) -> Entry:
    ops = [
        command_pb2.Op(
            init_producer=command_pb2.InitProducerOp(
                client_id=f"client-{index}-{k}" * 4, producer_id=index * 1000 + k + 1
            )
        )
        for k in range(n)
    ]
    return Entry(1, index, data=command_pb2.Command(leader_ms=1, ops=ops).SerializeToString())


def test_an_apply_cut_short_by_a_full_disk_is_disk_full(small_disk: Path) -> None:
    sm = StateMachine(small_disk / "state", map_size=64 << 20)
    sm.apply([_producers(1)])
    ballast = leave_free(small_disk, 3)
    todo = [_producers(i) for i in range(2, 6)]
    with pytest.raises(StorageFullError, match="disk full"):
        sm.apply(todo)
    assert sm.applied_index == 1  # nothing of it applied
    ballast.unlink()
    sm.apply(todo)  # room again: applied
    assert sm.applied_index == 5
