"""Installing a snapshot on a full disk (nemesis finding 13): a node
rebuilding its state after a power cut copies its snapshot into place; on a
disk with no room the copy failed with a bare OSError, and the node died of
a traceback at start instead of saying the disk is full (and, running, the
install was not retried). Now it is a StorageFullError, nothing changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.raft import StorageFullError
from node_daemon.state.machine import StateMachine
from tests.conftest import fill_up, small_tmpfs

pytestmark = pytest.mark.unit


def test_a_snapshot_install_on_a_full_disk_is_a_storage_full_error(tmp_path: Path) -> None:
    source = StateMachine(tmp_path / "source")
    snapshot = tmp_path / "snap.mdb"
    source.write_snapshot(snapshot)
    source.close()
    with small_tmpfs(tmp_path / "tiny", "2m", "the full-disk snapshot test") as mnt:
        sm = StateMachine(mnt / "state")
        before = sm.digest()
        fill_up(mnt / "fill")
        with pytest.raises(StorageFullError, match="disk full installing a snapshot"):
            sm.install_snapshot(snapshot)
        assert not (mnt / "state.incoming").exists()  # the partial copy is gone
        assert sm.digest() == before  # the old state, still open
        (mnt / "fill").unlink()  # room again: it installs
        sm.install_snapshot(snapshot)
        sm.close()
