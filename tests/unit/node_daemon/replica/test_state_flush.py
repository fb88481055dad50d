"""The state machine commits without fsync; what it applied is pushed to the
disk a little at a time while it runs (``Snapshots``' state flush), so that
neither a checkpoint nor the kernel's writeback of old dirty pages sends
hundreds of MiB at once for the log's fsyncs on the same disk to wait behind."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from node_daemon.raft import ConfState, Entry, HardState, SnapshotMeta, StorageError
from node_daemon.replica import snapshots
from node_daemon.replica.snapshots import Snapshots
from node_daemon.state.machine import StateMachine
from node_daemon.state.paced_copy import CopyCancelled
from node_daemon.storage.raft_log import LmdbLogStorage

pytestmark = pytest.mark.unit


class _Applying:
    """A state machine's face to ``Snapshots``: an applied index that the
    test moves, and checkpoints (fsyncs) it can hold."""

    group = 7  # the Raft group it is the state of
    refs_released = False  # retention let no batch's log entry go

    def __init__(self) -> None:
        self.applied_index = 0
        self.flushes: list[tuple[str, int]] = []  # (thread, applied when flushed)
        self.release = threading.Event()
        self.release.set()

    def checkpoint(self) -> None:
        self.flushes.append((threading.current_thread().name, self.applied_index))
        assert self.release.wait(10)

    def size_bytes(self) -> int:
        return 0


def _snapshots(
    tmp_path: Path, log_store: LmdbLogStorage, sm: StateMachine, write_rate: float | None = None
) -> Snapshots:
    """A one-voter node's snapshots of ``sm``, compacting ``log_store``."""
    return Snapshots(
        tmp_path / "snapshots",
        log_store,
        sm,
        meta_at=lambda i: SnapshotMeta(i, 1, ConfState(voters=frozenset({1}))),
        log_io=ThreadPoolExecutor(1),
        wakeup=lambda: None,
        max_entries=1000,
        max_bytes=1 << 20,
        write_rate=write_rate,
    )


def _flushing(tmp_path: Path) -> tuple[Snapshots, LmdbLogStorage, _Applying]:
    log_store = LmdbLogStorage(tmp_path / "raft", map_size=4 << 20)
    sm = _Applying()
    return _snapshots(tmp_path, log_store, sm), log_store, sm  # type: ignore[arg-type]


def _run_then_close(
    run: Callable[[], Coroutine[Any, Any, None]], snaps: Snapshots, log_store: LmdbLogStorage
) -> None:
    try:
        asyncio.run(run())
    finally:
        snaps.close()
        log_store.close()


def test_the_state_is_flushed_on_its_own_thread_one_flush_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the state applied goes to the disk a little at a time (not all
    at a checkpoint): a flush on its own thread once the applied index
    moved, never two at once, none when nothing moved; and ``taken`` waits
    for a flush (the state must not be replaced or closed under it)."""
    monkeypatch.setattr(snapshots, "STATE_FLUSH_S", 0.0)
    snaps, log_store, sm = _flushing(tmp_path)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        await snaps.between_readys(loop)
        await snaps.taken()
        assert sm.flushes == []  # nothing applied: nothing to flush
        sm.release.clear()
        sm.applied_index = 5
        await snaps.between_readys(loop)
        for i in range(6, 9):  # more applied while the flush is held
            sm.applied_index = i
            await snaps.between_readys(loop)
        waiting = asyncio.ensure_future(snaps.taken())
        for _ in range(20):  # turns of the loop, not time: the flush is held
            await asyncio.sleep(0)
        assert not waiting.done()  # a flush is out: taken() waits for it
        sm.release.set()
        await asyncio.wait_for(waiting, 10)
        assert len(sm.flushes) == 1
        assert sm.flushes[0][0].startswith("state-flush") and sm.flushes[0][1] >= 5
        await snaps.between_readys(loop)  # what moved meanwhile: flushed next
        await snaps.taken()
        assert [a for _, a in sm.flushes] == [sm.flushes[0][1], 8]
        await snaps.between_readys(loop)
        await snaps.taken()
        assert len(sm.flushes) == 2  # nothing moved since

    _run_then_close(run, snaps, log_store)


def test_flushes_are_state_flush_s_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshots, "STATE_FLUSH_S", 3600.0)
    snaps, log_store, sm = _flushing(tmp_path)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for i in range(1, 6):
            sm.applied_index = i
            await snaps.between_readys(loop)
            await snaps.taken()
        assert [a for _, a in sm.flushes] == [1]

    _run_then_close(run, snaps, log_store)


def test_a_failed_flush_stops_compaction_for_good(tmp_path: Path) -> None:
    """After a failed fsync the page cache may show what never reached the
    disk, and a later fsync can succeed without it: no snapshot (and so no
    compaction of the log) is taken again by this process."""
    snaps, log_store, sm = _flushing(tmp_path)

    def broken() -> None:
        raise OSError(5, "Input/output error")

    sm.checkpoint = broken  # type: ignore[method-assign]

    async def run() -> None:
        loop = asyncio.get_running_loop()
        sm.applied_index = 3
        await snaps.between_readys(loop)
        await snaps.taken()
        asked = asyncio.ensure_future(snaps.now())
        await asyncio.sleep(0)
        await snaps.between_readys(loop)  # begins the snapshot: it refuses
        await snaps.taken()
        await snaps.between_readys(loop)  # its outcome: the asker is told
        with pytest.raises(StorageError, match="fsync of the state failed"):
            await asyncio.wait_for(asked, 10)
        assert log_store.first_index() == 1  # nothing compacted
        failed = REGISTRY.get_sample_value("roadlog_state_fsync_failed", {"group": "7"})
        assert failed == 1  # what the alert RoadlogStateFsyncFailed watches

    _run_then_close(run, snaps, log_store)


def test_taken_gives_up_a_paced_snapshot_and_nothing_of_it_stays(tmp_path: Path) -> None:
    """A node that stops, or installs a snapshot from its leader, must not
    wait minutes behind a paced copy of its state: ``taken`` gives it up,
    whoever asked for it is told, and no file of it is left."""
    log_store = LmdbLogStorage(tmp_path / "raft", map_size=4 << 20)
    sm = StateMachine(tmp_path / "state")
    with sm.env.begin(write=True) as txn:  # 8 MiB to copy at 1 MiB/s
        db = sm.env.open_db(b"filler", txn=txn)
        for i in range(2048):
            txn.put(i.to_bytes(4, "big"), bytes(4000), db=db)
    snaps = _snapshots(tmp_path, log_store, sm, write_rate=float(1 << 20))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        entries = [Entry(term=1, index=i) for i in (1, 2, 3)]  # no-ops, applied
        log_store.save(HardState(term=1, vote=1, commit=3), entries)
        sm.apply(entries)
        asked = asyncio.ensure_future(snaps.now())
        await asyncio.sleep(0)
        await snaps.between_readys(loop)
        deadline = loop.time() + 10
        while not any(snaps.directory.glob("*.tmp/data.mdb")):
            assert loop.time() < deadline, "the paced copy never began"
            await asyncio.sleep(0.01)
        await asyncio.wait_for(snaps.taken(), 10)  # gives it up: seconds early
        await snaps.between_readys(loop)  # its outcome: the asker is told
        with pytest.raises(CopyCancelled):
            await asyncio.wait_for(asked, 10)
        assert not list(snaps.directory.iterdir())  # no partial copy left

    try:
        asyncio.run(run())
    finally:
        snaps.close()
        sm.close()
        log_store.close()


def test_a_snapshot_whose_checkpoint_fails_compacts_nothing_then_or_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log is compacted only up to a checkpoint (an fsync of the state).
    A snapshot whose checkpoint fails compacts nothing, and no later
    snapshot does either: the failure is as sticky as a flush's."""
    monkeypatch.setattr(snapshots, "STATE_FLUSH_S", 3600.0)
    log_store = LmdbLogStorage(tmp_path / "raft", map_size=4 << 20)
    sm = StateMachine(tmp_path / "state")
    entries = [Entry(term=1, index=i) for i in (1, 2, 3)]  # no-ops, applied
    log_store.save(HardState(term=1, vote=1, commit=3), entries)
    sm.apply(entries)
    snaps = _snapshots(tmp_path, log_store, sm)
    real = sm.checkpoint
    calls = [0]

    def fails_once() -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(5, "Input/output error")
        real()  # a later fsync succeeds: it proves nothing

    sm.checkpoint = fails_once  # type: ignore[method-assign]

    async def ask() -> None:
        loop = asyncio.get_running_loop()
        asked = asyncio.ensure_future(snaps.now())
        await asyncio.sleep(0)
        await snaps.between_readys(loop)  # begins it
        await snaps.taken()
        await snaps.between_readys(loop)  # its outcome
        await asyncio.wait_for(asked, 10)

    async def run() -> None:
        with pytest.raises(OSError, match="Input/output"):
            await ask()
        with pytest.raises(StorageError, match="fsync of the state failed earlier"):
            await ask()
        assert log_store.first_index() == 1  # nothing compacted

    try:
        _run_then_close(run, snaps, log_store)
    finally:
        sm.close()
