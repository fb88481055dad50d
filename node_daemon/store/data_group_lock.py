"""One process at a time runs a Raft group of a node: an exclusive lock on
the group's directory (``worker.lock``), held for the process's life and
released by the kernel when it dies (docs/multiraft.md step 5: a worker
started again while its predecessor is still exiting, or a main process
started with fewer workers beside an old worker, waits for it).

Invariant: a process opens a data group's log or state only while holding
the group's lock.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterable
from pathlib import Path

LOCK_FILE = "worker.lock"
LOCK_WAIT_S = 30.0  # a group's lock still held (its last process exiting): wait this long


class DataGroupBusyError(RuntimeError):
    """Another process still runs the group."""


def lock_data_groups(directories: Iterable[Path], wait_s: float = LOCK_WAIT_S) -> list[int]:
    """Lock each group directory (made if missing); returns the open
    descriptors that hold the locks (closing one releases its lock)."""
    fds: list[int] = []
    try:
        for d in directories:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
            fds.append(fd)
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise DataGroupBusyError(f"{d} is still run by another process") from None
                    time.sleep(0.1)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds
