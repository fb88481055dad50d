"""One process at a time runs a Raft group of a node: its directory's lock
is exclusive, waited for (bounded), and free again once its holder closed
it (or died: the kernel releases it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node_daemon.store.data_group_lock import DataGroupBusyError, lock_data_groups

pytestmark = pytest.mark.unit


def test_a_groups_lock_is_held_by_one_holder_at_a_time(tmp_path: Path) -> None:
    dirs = [tmp_path / "groups" / str(g) for g in (1, 2)]
    held = lock_data_groups(dirs)
    assert all((d / "worker.lock").exists() for d in dirs)
    with pytest.raises(DataGroupBusyError, match="groups/2"):
        lock_data_groups([tmp_path / "groups" / "3", dirs[1]], wait_s=0.2)
    # What the refused attempt took is released: group 3 is free.
    for fd in lock_data_groups([tmp_path / "groups" / "3"], wait_s=0.2):
        os.close(fd)
    for fd in held:
        os.close(fd)
    again = lock_data_groups(dirs, wait_s=0.2)
    for fd in again:
        os.close(fd)
