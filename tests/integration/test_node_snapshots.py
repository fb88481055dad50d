"""Snapshots on a real node (in this process, LMDB on disk): taking one
never holds up the write path, and the log is compacted to it afterwards."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
from prometheus_client import REGISTRY

from node_daemon.config import NodeConfig
from node_daemon.node import RaftNode
from roadlog.runtime.processes import free_port
from roadlog.v1 import command_pb2

pytestmark = pytest.mark.integration


async def _until(cond: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _op(i: int) -> command_pb2.Op:
    return command_pb2.Op(init_producer=command_pb2.InitProducerOp(client_id=f"c{i}"))


def test_writes_go_on_while_a_snapshot_is_taken(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    cfg = NodeConfig(
        node_id=1, data_dir=tmp_path / "n1", listen=addr, peers={1: addr}, snapshot_entries=5
    )

    async def main() -> None:
        node = RaftNode(cfg)
        taking, release = threading.Event(), threading.Event()
        real = node.sm.write_snapshot

        def held_snapshot(
            dest: str | os.PathLike[str],
            rate: float | None = None,
            cancel: threading.Event | None = None,
        ) -> tuple[int, int]:
            taking.set()
            release.wait(30)  # held until the writes below went through
            return real(dest, rate, cancel)

        node.sm.write_snapshot = held_snapshot  # type: ignore[method-assign]
        taken_before = REGISTRY.get_sample_value("roadlog_snapshot_seconds_count") or 0.0
        await node.start()
        try:
            await _until(lambda: node.is_leader, "a leader")
            for i in range(8):  # past snapshot_entries: a snapshot becomes due
                await asyncio.wait_for(node.propose_op(_op(i)), 10)
            await _until(taking.is_set, "the snapshot to begin")
            first = node.log_store.first_index()
            before = node.sm.applied_index
            for i in range(8, 28):  # the snapshot is held: writes must not be
                await asyncio.wait_for(node.propose_op(_op(i)), 10)
            assert node.sm.applied_index >= before + 20
            assert node.log_store.first_index() == first  # not compacted yet
            release.set()
            await _until(lambda: node.log_store.first_index() > first, "the log compaction")
            snap = node.log_store.snapshot().meta
            assert before <= snap.index <= node.sm.applied_index
            assert node.snapshots.file(snap.index, snap.term) is not None
            # An operator's snapshot covers everything applied when asked.
            await asyncio.wait_for(node.propose_op(_op(99)), 10)
            asked_at = node.sm.applied_index
            assert asked_at > snap.index
            index = await asyncio.wait_for(node.snapshot_now(), 20)
            assert index >= asked_at
            assert node.log_store.first_index() == index + 1
            assert node.log_store.snapshot().meta.index == index
            assert REGISTRY.get_sample_value("roadlog_snapshot_index") == index
            taken = REGISTRY.get_sample_value("roadlog_snapshot_seconds_count") or 0.0
            assert taken - taken_before == 2
            assert sorted(p.name for p in node.snapshots.directory.glob("snap-*.mdb")) == [
                f"snap-{index}-{node.log_store.snapshot().meta.term}.mdb"
            ]
        finally:
            release.set()
            await node.stop()

    asyncio.run(main())


def test_a_log_of_big_entries_is_snapshotted_by_its_bytes(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    cfg = NodeConfig(
        node_id=1,
        data_dir=tmp_path / "n1",
        listen=addr,
        peers={1: addr},
        snapshot_entries=1_000_000,  # never reached here
        snapshot_bytes=256 << 10,
    )

    async def main() -> None:
        node = RaftNode(cfg)
        before = REGISTRY.get_sample_value("roadlog_snapshot_seconds_count") or 0
        await node.start()
        try:
            await _until(lambda: node.is_leader, "a leader")
            big = command_pb2.Op(init_producer=command_pb2.InitProducerOp(client_id="x" * 20_000))
            for _ in range(30):  # ~600 KB of log, far fewer entries than snapshot_entries
                await asyncio.wait_for(node.propose_op(big), 10)
            await _until(lambda: node.log_store.first_index() > 1, "a snapshot by bytes")
            await _until(lambda: node.log_store.log_bytes() < 256 << 10, "the log to stay small")
            taken = (REGISTRY.get_sample_value("roadlog_snapshot_seconds_count") or 0) - before
            assert 1 <= taken <= 3  # ~600 KB of log: one per 256 KiB, not one an entry
        finally:
            await node.stop()

    asyncio.run(main())


def test_a_failed_log_write_stops_the_node_instead_of_leaving_it_half_alive(
    tmp_path: Path,
) -> None:
    """A failed write or apply ends the Raft driver; the node says so (the
    daemon then exits and systemd restarts it) and still closes cleanly."""
    addr = f"127.0.0.1:{free_port()}"
    cfg = NodeConfig(node_id=1, data_dir=tmp_path / "n1", listen=addr, peers={1: addr})

    async def main() -> None:
        node = RaftNode(cfg)
        failures: list[BaseException] = []
        await node.start(failures.append)
        try:
            await _until(lambda: node.is_leader, "a leader")
            await asyncio.wait_for(node.propose_op(_op(0)), 10)
            real = node.log_store.save

            def broken_save(*args: object, **kwargs: object) -> None:
                raise OSError(28, "No space left on device")

            node.log_store.save = broken_save  # type: ignore[method-assign]
            proposal = asyncio.ensure_future(node.propose_op(_op(1)))
            await _until(lambda: bool(failures), "the driver's failure to be reported")
            assert isinstance(failures[0], OSError)
            assert not proposal.done() or proposal.exception() is not None  # never acked
            proposal.cancel()
            node.log_store.save = real  # type: ignore[method-assign]
        finally:
            await node.stop()  # the failure does not keep it from closing
        with pytest.raises(lmdb.Error):  # closed: stop() ran to its end
            node.sm.env.stat()

    asyncio.run(main())
