"""Opening the Raft log or the state machine on a full disk is a clear
StorageFullError, not a SIGBUS that kills the node with nothing in its log
(nemesis finding 8: LMDB maps its lock file, made sparse, and the first
touch of a page the full filesystem cannot back killed the process). Each
open runs in a child process, so a regression fails the test instead of
killing the test run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import fill_up, small_tmpfs

pytestmark = pytest.mark.unit

OPEN = """
import sys
from node_daemon.raft import StorageFullError
from node_daemon.storage.raft_log import LmdbLogStorage
from node_daemon.state.machine import StateMachine
cls = {"log": LmdbLogStorage, "state": StateMachine}[sys.argv[1]]
try:
    cls(sys.argv[2])
except StorageFullError as e:
    print("StorageFullError:", e)
    sys.exit(3)
print("opened")
"""


@pytest.mark.parametrize("what", ["log", "state"])
def test_opening_on_a_full_disk_is_a_storage_full_error(tmp_path: Path, what: str) -> None:
    with small_tmpfs(tmp_path / "tiny", "1m", "the full-disk open test") as mnt:
        fill_up(mnt / "fill")
        child = subprocess.run(
            [sys.executable, "-c", OPEN, what, str(mnt / what)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert child.returncode != -signal.SIGBUS, "killed by SIGBUS"
    assert child.returncode == 3, (child.returncode, child.stdout, child.stderr)
    assert "disk full opening the" in child.stdout and "No space left" in child.stdout


def test_room_for_the_files_but_not_the_tables_is_a_storage_full_error(tmp_path: Path) -> None:
    """The state's files open, but creating its tables commits, and that
    commit finds no room (the nemesis: a node's disk filled while it started
    after a power cut, and it died with a raw lmdb.DiskError)."""
    with small_tmpfs(tmp_path / "tiny", "1m", "the full-disk open test") as mnt:
        fill = mnt / "fill"
        fill_up(fill)
        os.truncate(fill, fill.stat().st_size - 76 * 1024)  # the lock's 64 KiB and a little
        child = subprocess.run(
            [sys.executable, "-c", OPEN, "state", str(mnt / "state")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert child.returncode == 3, (child.returncode, child.stdout, child.stderr)
    assert "disk full opening the state" in child.stdout, child.stdout


def test_with_room_it_opens(tmp_path: Path) -> None:
    for what in ("log", "state"):
        child = subprocess.run(
            [sys.executable, "-c", OPEN, what, str(tmp_path / what)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (child.returncode, child.stdout.strip()) == (0, "opened"), child.stderr
