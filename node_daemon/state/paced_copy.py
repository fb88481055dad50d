"""Copying an LMDB environment to a file without flooding the disk.

A snapshot copies the whole state: hundreds of MiB to GiB at once. Left to
go as fast as it can, that reaches the disk in one burst, and every Raft log
fsync on the same disk waits behind it (measured at 1000 pings per message
on 2 cores: ack p99 125-480 ms in windows with a snapshot, 24-26 ms in
windows without). So the copy is paced: at most ``rate`` bytes a second.

How, as LMDB's own copy does it (``mdb_env_copyfd0``), but a chunk at a time:
under the writer's lock (a write transaction, held for two page reads) a
read transaction begins and the two meta pages are read as they are; the
one whose transaction id is the read transaction's describes its tree. The
pages up to that meta page's last page are never written again while the
read transaction is open (LMDB reuses only pages no reader can reach), so
they are copied from a read-only map of the data file, the meta pages first,
written O_DIRECT (no page cache, no copy through the CPU: 782 MiB cost
0.01-0.04 CPU-seconds, as LMDB's ``env.copy``), sleeping to the rate. Where
the file system has no O_DIRECT the writes go through the page cache and
are synced every ``sync_bytes``.

Where the data file is not what this expects (another meta layout, a meta
page that does not match the read transaction), LMDB copies it itself
(``env.copyfd``), unpaced. (A first version paced every copy through a
pipe, ``env.copyfd`` in and ``os.splice`` out: 0.45-0.65 CPU-seconds for
the same 782 MiB, which is why the pages are copied here instead.)

Invariants: ``dest`` ends up holding a consistent copy of the environment as
of one read transaction (byte for byte what ``env.copy`` writes when no
write commits meanwhile), fsynced. Nothing is left open when this returns
or raises (the read transaction, the maps, the files).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SYNC_BYTES = 16 << 20  # at most this much of a buffered copy waits in the page cache
CHUNK_BYTES = 1 << 20  # what one write moves at most

# The meta page (LMDB 0.9, lmdb.h's MDB_meta after the 16-byte page header):
# magic and version at 16, the last page used and the transaction id at 136.
_MAGIC_VERSION = struct.Struct("<II")
_LAST_PG_TXNID = struct.Struct("<QQ")
_MAGIC, _VERSION = 0xBEEFC0DE, 1
_NUM_METAS = 2


class _Unexpected(Exception):
    """The data file is not as this module reads it: LMDB copies it."""


class CopyCancelled(Exception):
    """The copy was given up (``cancel`` was set): the node stops, or a
    snapshot from the leader replaces the state being copied."""


def copy_paced(
    env: Any,
    dest: str | os.PathLike[str],
    rate: float | None = None,
    sync_bytes: int = SYNC_BYTES,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] | None = None,
    cancel: threading.Event | None = None,
) -> int:
    """Copy ``env`` (an open ``lmdb.Environment`` kept in a directory) to
    the file ``dest``, at most ``rate`` bytes a second (None: unpaced), and
    fsync it; the bytes written. Setting ``cancel`` gives the copy up within
    a chunk (CopyCancelled; what was written of ``dest`` stays, for the
    caller to remove): a paced copy of a big state takes minutes."""
    cancel = cancel if cancel is not None else threading.Event()
    nap = sleep if sleep is not None else cancel.wait
    try:
        return _copy_pages(env, Path(dest), _Pace(rate, clock, nap, cancel), sync_bytes)
    except _Unexpected:
        with open(dest, "wb") as f:
            env.copyfd(f.fileno())
            os.fsync(f.fileno())
            return os.fstat(f.fileno()).st_size


class _Pace:
    """Sleeps so that ``done`` bytes never go out faster than ``rate``;
    raises CopyCancelled once ``cancel`` is set."""

    def __init__(
        self,
        rate: float | None,
        clock: Callable[[], float],
        sleep: Callable[[float], object],
        cancel: threading.Event,
    ) -> None:
        self.rate, self.clock, self.sleep, self.cancel = rate, clock, sleep, cancel
        self.start = clock()

    def __call__(self, done: int) -> None:
        if self.rate:
            ahead = done / self.rate - (self.clock() - self.start)
            if ahead > 0:
                self.sleep(ahead)
        if self.cancel.is_set():
            raise CopyCancelled("the snapshot copy was given up")


def _open_dest(dest: Path) -> tuple[int, bool]:
    """``dest`` opened for writing, O_DIRECT where the file system has it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(dest, flags | os.O_DIRECT, 0o600), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return os.open(dest, flags, 0o600), False


def _copy_pages(env: Any, dest: Path, pace: _Pace, sync_bytes: int) -> int:
    psize = int(env.stat()["psize"])
    with contextlib.ExitStack() as stack:
        src = os.open(Path(env.path()) / "data.mdb", os.O_RDONLY)
        stack.callback(os.close, src)
        txn, metas = _begin_with_metas(env, src, psize)
        stack.callback(txn.abort)
        size = (_meta_of(metas, psize, txn.id()) + 1) * psize
        if os.fstat(src).st_size < size:
            raise _Unexpected
        out, direct = _open_dest(dest)
        stack.callback(os.close, out)
        view = memoryview(stack.enter_context(mmap.mmap(src, size, prot=mmap.PROT_READ)))
        stack.callback(view.release)  # before the map closes
        # The meta pages as read (the map's may have moved on), from a
        # page-aligned buffer, as O_DIRECT wants.
        head = stack.enter_context(mmap.mmap(-1, len(metas)))
        head[:] = metas
        _write_all(out, memoryview(head))
        done = synced = len(metas)
        while done < size:
            n = min(CHUNK_BYTES, size - done)
            _write_all(out, view[done : done + n])
            done += n
            if not direct and done - synced >= sync_bytes:
                os.fdatasync(out)
                os.posix_fadvise(out, synced, done - synced, os.POSIX_FADV_DONTNEED)
                synced = done
            pace(done)
        os.fsync(out)
        return size


def _begin_with_metas(env: Any, src: int, psize: int) -> tuple[Any, bytes]:
    """A read transaction and the meta pages as it began: both taken while
    a write transaction holds the writer's lock, so that no commit moves
    them in between (the write transaction writes nothing)."""
    writer = env.begin(write=True)
    try:
        txn = env.begin()
        try:
            metas = os.pread(src, _NUM_METAS * psize, 0)
        except BaseException:
            txn.abort()
            raise
    finally:
        writer.abort()
    if len(metas) != _NUM_METAS * psize:
        txn.abort()
        raise _Unexpected
    return txn, metas


def _meta_of(metas: bytes, psize: int, txnid: int) -> int:
    """The last page of the tree of transaction ``txnid``, from its meta page."""
    for i in range(_NUM_METAS):
        page = i * psize
        if _MAGIC_VERSION.unpack_from(metas, page + 16) != (_MAGIC, _VERSION):
            raise _Unexpected
        last_pg, meta_txnid = _LAST_PG_TXNID.unpack_from(metas, page + 136)
        if meta_txnid == txnid:
            return int(last_pg)
    raise _Unexpected


def _write_all(fd: int, data: memoryview) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    finally:
        data.release()  # a failed write's traceback must not pin the map
