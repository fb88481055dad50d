"""Copying an LMDB environment to a file without flooding the disk.

A snapshot copies the whole state: hundreds of MiB to GiB at once. Left to
the page cache, that reaches the disk in one burst at the copy's fsync, and
every Raft log fsync on the same disk waits behind it (measured at 1000
pings per message on 2 cores: ack p99 125-480 ms in windows with a snapshot,
24-26 ms in windows without). So the copy goes through a pipe into the file
(``os.splice``: the bytes never pass through Python), the written range is
pushed to the disk every ``sync_bytes`` and dropped from the page cache
(nobody reads a snapshot soon), and at most ``rate`` bytes go out a second.

The price is CPU: the pipe costs about 0.5-0.6 CPU-seconds per GiB copied,
where LMDB's own copy (``env.copy``, O_DIRECT from its map) costs next to
none but cannot be paced (measured with 782 MiB: 0.45-0.65 s against
0.01-0.04 s). With the default snapshot schedule that is about 0.1 server
CPU-seconds per million pings at 1000 pings per message (3 nodes); without
pacing the snapshots' bursts stalled acks for up to 0.9 s.

Invariants: the file ends up holding exactly what ``env.copyfd`` writes (a
consistent copy as of one read transaction), synced up to its last
``sync_bytes`` boundary; the caller fsyncs it whole. Nothing is left
running when this returns or raises: the copying thread is joined, both
ends of the pipe are closed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable
from typing import Any

SYNC_BYTES = 16 << 20  # at most this much of the copy waits in the page cache
_PIPE_BYTES = 1 << 20  # what one splice moves at most (the pipe's size, where allowed)


def _move(r: int, fd: int) -> int:
    """Up to _PIPE_BYTES from the pipe into the file; 0 at the copy's end."""
    try:
        return os.splice(r, fd, _PIPE_BYTES)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
    data = os.read(r, _PIPE_BYTES)  # a file system without splice
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return len(data)


def copy_paced(
    env: Any,
    fd: int,
    rate: float | None = None,
    sync_bytes: int = SYNC_BYTES,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Copy ``env`` (an open ``lmdb.Environment``) into the file open at
    ``fd``, at most ``rate`` bytes a second (None: as fast as the disk
    takes it, ``sync_bytes`` at a time); the bytes written."""
    r, w = os.pipe()
    with contextlib.suppress(OSError):  # above fs.pipe-max-size: the default size
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    failed: list[BaseException] = []

    def copy() -> None:
        try:
            env.copyfd(w)
        except BaseException as e:  # handed to the caller
            failed.append(e)
        finally:
            os.close(w)

    copier = threading.Thread(target=copy, name="snapshot-copy", daemon=True)
    copier.start()
    written = synced = 0
    start = clock()
    try:
        while True:
            n = _move(r, fd)
            if n == 0:
                break
            written += n
            if written - synced >= sync_bytes:
                os.fdatasync(fd)
                os.posix_fadvise(fd, synced, written - synced, os.POSIX_FADV_DONTNEED)
                synced = written
            if rate:
                ahead = written / rate - (clock() - start)
                if ahead > 0:
                    sleep(ahead)
    finally:
        os.close(r)  # a copy still writing gets EPIPE and ends
        copier.join()
    if failed:
        raise failed[0]
    return written
