"""Free space on the data directory's filesystem, and what a node does when
it runs low: it keeps serving reads and keeps its log and state consistent,
but, as leader, refuses operations that grow the data until there is room.

Two signals say the disk is low: a periodic look at the filesystem (free
bytes below ``min_free_bytes``), and a write that failed for want of space
(``StorageFullError``: the disk, or the LMDB map at its maximum size). A
failed log write or apply is retried, with backoff, until it goes through
(see ``Replica``); it is never given up, since Raft cannot skip a write.

Invariant: ``low`` is True from a failed write until a retry of it goes
through, and whenever the last look found less than ``min_free_bytes``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from node_daemon.raft.errors import StorageFullError
from roadlog.errors import Code, RoadlogError

LOOK_EVERY_S = 0.25  # statvfs is cheap, but not free for every proposal
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 2.0

# LMDB reports a write that stored fewer bytes than asked as EIO, not ENOSPC:
# that is what a filling disk does to a commit bigger than the room left. An
# I/O error while less than this is free is taken for a full disk.
SHORT_WRITE_ROOM = 1 << 20

# The operations that grow what a node stores; refused while the disk is low.
# Everything else is small, and some of it frees space (delete_topic, trim).
GROWING_OPS = frozenset({"append", "create_topic", "put_heatmap"})


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of path."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def full_disk_error(err: BaseException, path: str | os.PathLike[str]) -> bool:
    """Whether a failed write to the filesystem of ``path`` was for want of
    space: ENOSPC (LMDB's "No space left"), or an I/O error while less than
    SHORT_WRITE_ROOM is free (a write cut short by the disk filling). An
    I/O error with room left is a failing disk: not this."""
    text = str(err)
    if getattr(err, "errno", None) == errno.ENOSPC or "No space left" in text:
        return True
    if getattr(err, "errno", None) == errno.EIO or "Input/output error" in text:
        try:
            return free_bytes(str(path)) < SHORT_WRITE_ROOM
        except OSError:
            return False
    return False


LMDB_LOCK_BYTES = 64 << 10  # room for LMDB's lock file (its reader table)


def data_file_identity(directory: Path) -> tuple[int, int] | None:
    """(device, inode) of the LMDB data file in ``directory`` now (None:
    none): an environment replaced under the same path is another file."""
    try:
        st = os.stat(directory / "data.mdb")
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the names in directory ``path`` durable (files created, renamed
    or removed there): fsync the directory itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Replace the small file ``path`` with ``text``, atomically and durably:
    a temporary file fsynced, renamed over it, its directory fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def reserve_lmdb_lock(directory: str | os.PathLike[str]) -> None:
    """Give an LMDB environment's lock file its room on disk before
    ``lmdb.open``. LMDB sizes that file with ftruncate (a sparse file) and
    maps it; on a full filesystem the first touch of one of its pages kills
    the process with SIGBUS, with nothing in its log. With the room taken
    first (posix_fallocate), a full disk is an OSError here instead:
    ENOSPC, which callers report as a full disk (``full_disk_error``)."""
    path = os.path.join(os.fspath(directory), "lock.mdb")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(os.fstat(fd).st_size, LMDB_LOCK_BYTES))
    finally:
        os.close(fd)


def open_lmdb(directory: Path, what: str, **options: Any) -> lmdb.Environment:
    """``lmdb.open(directory, **options)`` with its lock file's room taken
    first (``reserve_lmdb_lock``); a full disk is ``StorageFullError``
    ("disk full opening the <what> in <directory>"), never a SIGBUS."""
    try:
        reserve_lmdb_lock(directory)
        env = lmdb.open(str(directory), **options)
        if not options.get("readonly"):
            # The files' names, and the directory's own, survive a power
            # loss from here on (LMDB fsyncs file contents, never names).
            fsync_dir(directory)
            fsync_dir(Path(directory).resolve().parent)
        return env
    except (OSError, lmdb.Error) as e:
        if isinstance(e, lmdb.DiskError) or full_disk_error(e, directory):
            raise StorageFullError(f"disk full opening the {what} in {directory}: {e}") from e
        raise


@dataclass
class DiskGuard:
    """Whether a node's disk is too full to take growing writes."""

    path: str
    min_free_bytes: int
    clock: Callable[[], float]
    free: Callable[[str], int] = free_bytes
    free_now: int = -1  # at the last look
    _looked: float = float("-inf")
    _failed: bool = False  # a write failed for want of space, and no retry went through yet
    _retry_s: float = RETRY_FIRST_S

    def look(self, force: bool = False) -> None:
        """Read the free space (at most every LOOK_EVERY_S unless forced)."""
        now = self.clock()
        if not force and now - self._looked < LOOK_EVERY_S:
            return
        self._looked = now
        try:
            self.free_now = self.free(self.path)
        except OSError:
            return  # keep the last figure: an unreadable path says nothing

    @property
    def low(self) -> bool:
        self.look()
        return self._failed or 0 <= self.free_now < self.min_free_bytes

    @property
    def failing(self) -> bool:
        """A write failed for want of space and none went through since."""
        return self._failed

    def write_failed(self) -> float:
        """A write failed for want of space: low from now on; the seconds to
        wait before trying it again (doubling, up to RETRY_MAX_S)."""
        self._failed = True
        wait = self._retry_s
        self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
        return wait

    def write_succeeded(self) -> None:
        """A retried write went through."""
        self._failed = False
        self._retry_s = RETRY_FIRST_S

    def refuse(self, op_kind: str | None, node_id: int) -> None:
        """Raise RESOURCE_EXHAUSTED for a growing op while the disk is low."""
        if op_kind in GROWING_OPS and self.low:
            free = f"{self.free_now / 2**20:.0f} MiB free" if self.free_now >= 0 else "full"
            raise RoadlogError(
                Code.RESOURCE_EXHAUSTED,
                f"node {node_id}'s disk is nearly full ({free}, min_free_bytes "
                f"{self.min_free_bytes / 2**20:.0f} MiB): writes are refused until space "
                "is freed (delete topics, shorten retention, or add disk); reads go on",
            )
