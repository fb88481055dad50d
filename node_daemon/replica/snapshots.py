"""When and how a node compacts its Raft log into a snapshot of its state.

A snapshot is a compact copy of the state machine's LMDB environment, taken
on its own thread from one read transaction while the driver goes on
writing; only compacting the log to it happens between Readys, on the
event loop (``Snapshots.between_readys``).

Invariants:
- At most one snapshot is being taken at a time.
- The log is compacted to a snapshot only once it is durable: the copy is
  written and renamed into place, and the state machine's own environment
  is fsynced up to the copy's index (``checkpoint``), so a crash after the
  compaction finds every compacted entry in the state.
- A snapshot installed from the leader while one was being taken wins: the
  older local copy is dropped, the log keeps the newer one.
- Everyone who asked for a snapshot (``now``) is answered with the index of
  a snapshot that covers everything applied when they asked, or its error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lmdb

from node_daemon import metrics
from node_daemon.raft import Snapshot, SnapshotMeta, StorageError
from node_daemon.raft.errors import MissingEntryError
from node_daemon.state.machine import StateMachine
from node_daemon.state.paced_copy import CopyCancelled
from node_daemon.storage import kept_log
from node_daemon.storage.disk import fsync_dir
from node_daemon.storage.raft_log import LmdbLogStorage
from node_daemon.transport.peer_transport import received_path

log = logging.getLogger("roadlog.node")

SNAPSHOT_RETRY_S = 5.0  # after a failed snapshot, before the next try
SNAPSHOT_LOG_SHARE = 0.5  # a big state is snapshotted once the log is this share of it
# How often at most the driver asks whether a snapshot is due: asking reads
# LMDB statistics, and the driver wakes hundreds of times a second under load.
SNAPSHOT_CHECK_S = 0.1
# How often at most the state's commits (made without fsync) are pushed to
# the disk while it applies: a little at a time, so that neither a
# checkpoint nor the kernel's writeback of old dirty pages sends hundreds of
# MiB at once, which the log's fsyncs on the same disk would wait behind.
STATE_FLUSH_S = 0.25
# At most this often a snapshot is taken only to let the log release entries
# that retention no longer needs (the state is small: a copy costs little).
RELEASE_EVERY_S = 10.0


def snapshot_due(
    entries: int,
    log_bytes: int,
    state_bytes: Callable[[], int],
    max_entries: int,
    max_bytes: int,
) -> bool:
    """Whether a log whose applied part holds ``entries`` entries of
    ``log_bytes`` bytes should be compacted into a snapshot: once it reaches
    ``max_entries`` or ``max_bytes``; but a state machine bigger than
    ``max_bytes`` is copied only once that log is at least SNAPSHOT_LOG_SHARE
    of its size, which bounds the copying to a few times what is written
    (days of pings are not copied again for every few minutes of log)."""
    if entries < max_entries and log_bytes < max_bytes:
        return False
    state = state_bytes()
    return state <= max_bytes or log_bytes >= state * SNAPSHOT_LOG_SHARE


class Snapshots:
    """A node's snapshot files and the schedule of taking them.

    ``log_io`` is the executor that owns the log's LMDB writes (compaction
    runs there, in order with the driver's writes); ``wakeup`` wakes the
    driver task when a snapshot being taken is done."""

    def __init__(
        self,
        directory: Path,
        log_store: LmdbLogStorage,
        sm: StateMachine,
        meta_at: Callable[[int], SnapshotMeta],
        log_io: Executor,
        wakeup: Callable[[], None],
        max_entries: int,
        max_bytes: int,
        index_gauge: Any = None,
        write_rate: float | None = None,
    ) -> None:
        """``index_gauge``: where the index compacted to is shown (default:
        ``roadlog_snapshot_index``, group 0's); ``write_rate``: bytes a
        second a snapshot is written at, at most (None: unpaced)."""
        self.directory = directory
        self._index_gauge = index_gauge if index_gauge is not None else metrics.SNAPSHOT_INDEX
        directory.mkdir(parents=True, exist_ok=True)
        self._log_store = log_store
        self._sm = sm
        self._meta_at = meta_at
        self._log_io = log_io
        self._wakeup = wakeup
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._write_rate = write_rate
        self._requests: list[asyncio.Future[int]] = []
        self._io = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        # Bundling a snapshot with the log entries its state refers to, for
        # a follower (``shipped``); one bundle per snapshot, made once.
        self._ship_io = ThreadPoolExecutor(1, thread_name_prefix="snapshot-ship")
        self._shipping: dict[tuple[int, int], asyncio.Future[None]] = {}
        self._flush_io = ThreadPoolExecutor(1, thread_name_prefix="state-flush")
        self._flushing: asyncio.Future[None] | None = None
        self._flushed_index = sm.applied_index
        self._next_flush = 0.0
        self._flush_failed: BaseException | None = None  # sticky: see _flushed
        self._give_up = threading.Event()  # set by taken(): a paced copy stops
        self._taking: asyncio.Future[tuple[int, int, Path, int | None]] | None = None
        self._waiters: list[asyncio.Future[int]] = []  # asked before it began
        # No snapshot_due() check before this (SNAPSHOT_CHECK_S apart; after
        # a failed snapshot, SNAPSHOT_RETRY_S); asking for one skips the wait.
        self._next_check = 0.0
        self._next_release = 0.0  # no snapshot for released references before this
        self._phases: dict[str, float] = {}  # the last snapshot's, for its log line
        self._kept_gauge = metrics.LOG_KEPT_FROM.labels(str(sm.group))
        self._kept_gauge.set(log_store.retained_from())

    # ------------------------------------------------------------- files

    def path(self, index: int, term: int) -> Path:
        return self.directory / f"snap-{index}-{term}.mdb"

    def file(self, index: int, term: int) -> Path | None:
        """The local snapshot at (``index``, ``term``), if it is here (what
        the transport sends to a follower behind the compacted log): one
        this node took (``snap-*``) or one it received from an earlier
        leader (``recv-*``, kept while its log names it), which it must pass
        on once it leads itself."""
        for p in (self.path(index, term), received_path(self.directory, index, term)):
            if p.exists():
                return p
        return None

    def ship_path(self, index: int, term: int) -> Path:
        return self.directory / f"ship-{index}-{term}.mdb"

    async def shipped(self, index: int, term: int) -> Path | None:
        """The file a follower behind the log is sent for the snapshot at
        (``index``, ``term``): the local one, bundled with the log entries
        its state refers to (``kept_log``) unless it carries them already or
        refers to none; made once, on a thread, and kept until a newer
        snapshot replaces it. None if the snapshot is not here, or the log
        no longer keeps what it refers to (Raft then sends a newer one)."""
        src = self.file(index, term)
        if src is None:
            return None
        lo = self._log_store.retained_from()
        if lo > index or kept_log.kept_range(src) is not None:
            return src
        ship = self.ship_path(index, term)
        if ship.exists():
            return ship
        key = (index, term)
        fut = self._shipping.get(key)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self._ship_io, self._log_store.bundle, src, ship, index)
            self._shipping[key] = fut
            fut.add_done_callback(lambda _: self._shipping.pop(key, None))
        try:
            await asyncio.shield(fut)
        except (MissingEntryError, OSError, lmdb.Error) as e:
            # The log let entries go, or a newer snapshot removed this one
            # meanwhile: Raft sends a newer snapshot.
            log.info("snapshot not bundled", extra={"index": index, "why": repr(e)})
            return None
        return ship if ship.exists() else None

    def _remove_old(self, keep: Path) -> None:
        for old in self.directory.glob("snap-*.mdb"):
            if old != keep:
                old.unlink(missing_ok=True)
        for old in self.directory.glob("ship-*.mdb*"):
            old.unlink(missing_ok=True)  # bundles of older snapshots (and their leftovers)
        current = Path(self._log_store.snapshot().data.decode()).resolve()
        for old in self.directory.glob("recv-*.mdb"):
            if old.resolve() != current:
                old.unlink(missing_ok=True)

    # ---------------------------------------------------------- schedule

    async def install(self, snap: Snapshot, io: Executor) -> None:
        """Install ``snap`` in the state machine (on ``io``), once a snapshot
        being taken is done: its thread reads the state being replaced."""
        await self.taken()
        await asyncio.get_running_loop().run_in_executor(
            io, self._sm.install_snapshot, snap.data.decode()
        )
        self._index_gauge.set(snap.meta.index)
        log.info("installed snapshot", extra={"index": snap.meta.index, "group": self._sm.group})

    async def now(self) -> int:
        """Snapshot the state machine and compact the log now; the index of
        the snapshot that covers everything applied when asked."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._requests.append(fut)
        self._wakeup()
        return await fut

    async def between_readys(self, loop: asyncio.AbstractEventLoop) -> None:
        """Compact the log to a snapshot finished in the background, and
        begin one when the applied log has grown ``max_entries`` or
        ``max_bytes`` past the last, or one was asked for."""
        self._flush_state(loop)
        task = self._taking
        if task is not None and task.done():
            self._taking = None
            waiters, self._waiters = self._waiters, []
            await self._compact_to(loop, task, waiters)
        self._begin_if_due(loop)

    def between_readys_now(self, loop: asyncio.AbstractEventLoop) -> bool:
        """``between_readys`` when it need not wait, done here: False (and
        nothing done) when a snapshot taken waits to compact the log, which
        ``between_readys`` awaits."""
        task = self._taking
        if task is not None and task.done():
            return False
        self._flush_state(loop)
        self._begin_if_due(loop)
        return True

    def _begin_if_due(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin a snapshot if one is due or asked for (none is being taken)."""
        if self._taking is not None:
            return
        applied, first = self._sm.applied_index, self._log_store.first_index()
        asked = bool(self._requests)
        if applied < first:  # nothing applied past the last snapshot: it covers all
            current = self._log_store.snapshot().meta.index
            for f in self._requests:
                if not f.done():
                    f.set_result(current)
            self._requests = []
            return
        now = time.monotonic()
        if not asked and now < self._next_check:
            return
        self._next_check = now + SNAPSHOT_CHECK_S
        # Retention let batches go: their log entries go at a compaction
        # (one copy per node: the log keeps what the state refers to).
        released = self._sm.refs_released and now >= self._next_release
        if (
            asked
            or released
            or snapshot_due(
                applied - first + 1,
                self._applied_log_bytes(applied, first),
                self._sm.size_bytes,
                self._max_entries,
                self._max_bytes,
            )
        ):
            self._waiters, self._requests = self._requests, []
            self._next_release = now + RELEASE_EVERY_S
            self._sm.refs_released = False  # what is released from here on: the next one
            self._taking = loop.run_in_executor(self._io, self._take)
            self._taking.add_done_callback(lambda _: self._wakeup())

    def _flush_state(self, loop: asyncio.AbstractEventLoop) -> None:
        """Push what the state applied since the last flush to the disk, on
        its own thread, at most every STATE_FLUSH_S (one flush at a time)."""
        applied = self._sm.applied_index
        if applied == self._flushed_index or (
            self._flushing is not None and not self._flushing.done()
        ):
            return
        now = time.monotonic()
        if now < self._next_flush:
            return
        self._next_flush = now + STATE_FLUSH_S
        self._flushed_index = applied
        self._flushing = loop.run_in_executor(self._flush_io, self._flush)
        self._flushing.add_done_callback(self._flushed)

    def _flush(self) -> None:
        """(flush thread) fsync what the state applied; timed."""
        with metrics.STATE_FLUSH_SECONDS.time():
            self._sm.checkpoint()

    def _flushed(self, f: asyncio.Future[None]) -> None:
        e = None if f.cancelled() else f.exception()
        if e is not None:
            self._fsync_failed(e)

    def _fsync_failed(self, e: BaseException) -> None:
        """A failed fsync may have dropped what it was to write while the
        page cache still shows it (so a later fsync can succeed and prove
        nothing): the log is never compacted again by this process (the
        first failure is kept, shown and logged)."""
        if self._flush_failed is not None:
            return
        self._flush_failed = e
        metrics.STATE_FSYNC_FAILED.labels(str(self._sm.group)).set(1)
        log.error(
            "an fsync of the state failed: the log is no longer compacted; "
            "restart the node once the disk is sound",
            extra={"error": repr(e), "group": self._sm.group},
        )

    def _applied_log_bytes(self, applied: int, first: int) -> int:
        """The bytes of the log's applied part (its share of the log's pages):
        entries not applied yet cannot be compacted, so they never make a
        snapshot due (else a slow applier would take one after another)."""
        last = self._log_store.last_index()
        if last < first:
            return 0
        return self._log_store.log_bytes() * (applied - first + 1) // (last - first + 1)

    def _take(self) -> tuple[int, int, Path, int | None]:
        """(snapshot thread) A compact copy of the state machine as one read
        transaction sees it, then an fsync of all it has applied: the log
        may be compacted to the copy's index only once that is durable.
        Also the lowest log index the copy's batches may refer to (looked up
        before the copy: it only grows), which the log keeps."""
        if self._flush_failed is not None:
            raise StorageError(f"an fsync of the state failed earlier: {self._flush_failed!r}")
        t0 = time.perf_counter()
        oldest = self._sm.oldest_entry_ref()
        taking = self.directory / "snap-taking.mdb"
        index, term = self._sm.write_snapshot(taking, self._write_rate, self._give_up)
        path = self.path(index, term)
        os.replace(taking, path)
        fsync_dir(self.directory)  # its name survives a power loss before the log names it
        t1 = time.perf_counter()
        try:
            self._sm.checkpoint()
        except BaseException as e:
            self._fsync_failed(e)
            raise
        t2 = time.perf_counter()
        metrics.SNAPSHOT_SECONDS.observe(t2 - t0)
        self._phases = {
            "copy_s": round(t1 - t0, 3),
            "checkpoint_s": round(t2 - t1, 3),
            "bytes": path.stat().st_size,
        }
        return index, term, path, oldest

    async def _compact_to(
        self,
        loop: asyncio.AbstractEventLoop,
        task: asyncio.Future[tuple[int, int, Path, int | None]],
        waiters: list[asyncio.Future[int]],
    ) -> None:
        """Compact the log to a finished snapshot and answer who asked for it."""
        try:
            index, _, path, oldest = task.result()
            current = self._log_store.snapshot().meta.index
            if index <= current:  # a newer one was installed from the leader meanwhile
                path.unlink(missing_ok=True)
                index = current
            else:
                snap = Snapshot(self._meta_at(index), str(path).encode())
                t0 = time.perf_counter()
                # The entries the copy's batches refer to stay (one copy per
                # node: docs/one-copy.md); the rest up to the index go.
                keep = index + 1 if oldest is None else oldest
                await loop.run_in_executor(self._log_io, self._log_store.compact, snap, keep)
                compact_s = round(time.perf_counter() - t0, 3)
                self._remove_old(path)
                self._index_gauge.set(index)
                self._kept_gauge.set(self._log_store.retained_from())
                log.info(
                    "snapshot and compaction",
                    extra={
                        "index": index,
                        **self._phases,
                        "compact_s": compact_s,
                        "kept_from": self._log_store.retained_from(),
                    },
                )
        except Exception as e:
            if isinstance(e, CopyCancelled):
                log.info("snapshot given up", extra={"why": "the state is replaced or closed"})
            else:
                log.exception("snapshot failed")
            self._next_check = time.monotonic() + SNAPSHOT_RETRY_S
            for f in waiters:
                if not f.done():
                    f.set_exception(e)
            return
        for f in waiters:
            if not f.done():
                f.set_result(index)

    async def taken(self) -> None:
        """Give up a snapshot being taken (a paced copy of a big state takes
        minutes; its outcome, CopyCancelled, is handled later) and wait for
        it and a flush of the state: their threads use the state, which is
        about to be replaced or closed."""
        busy = [f for f in (self._taking, self._flushing) if f is not None]
        if busy:
            self._give_up.set()
            try:
                await asyncio.wait(busy)
            finally:
                self._give_up.clear()

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._ship_io.shutdown(wait=True)
        self._flush_io.shutdown(wait=True)
