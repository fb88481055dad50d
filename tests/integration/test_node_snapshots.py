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
from node_daemon.replica.replica import Replica
from node_daemon.state import batch_refs, batch_store, unsynced
from node_daemon.state.machine import append_op, trim_op
from node_daemon.storage import kept_log
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.geo import bbox_region
from roadlog.partitioning import split_by_partition
from roadlog.runtime.processes import free_port
from roadlog.v1 import client_pb2, command_pb2, topics_pb2

pytestmark = pytest.mark.integration

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson


def pings(n: int, start: int, devices: int) -> PingColumns:
    now = int(time.time() * 1000)  # within the topic's retention
    return PingColumns.from_columns(
        [f"car-{i % devices}" for i in range(start, start + n)],
        [now + i for i in range(start, start + n)],
        [48.1] * n,
        [11.5] * n,
    )


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
        node = Replica(cfg)
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
        node = Replica(cfg)
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
        node = Replica(cfg)
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


async def _leader_with_pings(
    node: Replica, create: command_pb2.Op, appends: list[command_pb2.Op]
) -> tuple[int, int]:
    """Start ``node`` (one voter), make a topic and append to it; the index
    of the first append and of the last."""
    await node.start()
    await _until(lambda: node.is_leader, "a leader")
    await asyncio.wait_for(node.propose_op(create), 10)
    first = node.sm.applied_index + 1
    for op in appends:
        await asyncio.wait_for(node.propose_op(op), 10)
    return first, node.sm.applied_index


def test_pings_are_kept_once_in_the_log_through_compactions_and_restarts(tmp_path: Path) -> None:
    """A node stores each appended batch once: in its Raft log, which keeps
    the entries past compaction; its state refers to them. A follower
    behind the log is sent the snapshot bundled with those entries. After
    its host lost power, the node rebuilds its state from its snapshot and
    log, and the kept entries make it whole."""
    addr = f"127.0.0.1:{free_port()}"
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    cfg = NodeConfig(
        node_id=1,
        data_dir=tmp_path / "n1",
        listen=addr,
        peers={1: addr},
        snapshot_entries=5,
        boot_id_file=boot,
    )
    spec = topics_pb2.TopicSpec(name="munich", region_geojson=REGION, partitions=4)
    create = command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))
    sent = [pings(30, start=k * 30, devices=5) for k in range(12)]

    def read_all(node: Replica) -> list[int]:
        out: list[int] = []
        for p in range(4):
            resp = node.sm.fetch(client_pb2.FetchRequest(topic="munich", partition=p))
            for b in resp.batches:
                out += columnar.decode(b.batch).ts_ms.tolist()
        return sorted(out)

    want = sorted(t for cols in sent for t in cols.ts_ms.tolist())

    async def main() -> None:
        node = Replica(cfg)
        appends = [append_op("munich", split_by_partition(c, 4), 0, 0) for c in sent]
        try:
            first_append, _ = await _leader_with_pings(node, create, appends)
            index = await asyncio.wait_for(node.snapshot_now(), 20)
            assert node.log_store.first_index() == index + 1 > first_append
            assert node.log_store.retained_from() == first_append  # kept for the state
            with node.sm.env.begin() as txn:
                values = [bytes(v) for _, v in txn.cursor(db=node.sm.pings.batches)]
            assert values and all(batch_refs.is_ref(v, batch_store.HEADER.size) for v in values)
            assert read_all(node) == want
            term = node.log_store.snapshot().meta.term
            ship = await node.snapshots.shipped(index, term)
            assert ship is not None and ship.name == f"ship-{index}-{term}.mdb"
            assert kept_log.kept_range(ship) == (first_append, index)
            assert await node.snapshots.shipped(index, term) == ship  # made once
        finally:
            await node.stop()
        again = Replica(cfg)
        await again.start()
        try:
            await _until(lambda: again.is_leader, "a leader again")
            assert read_all(again) == want
        finally:
            await again.stop()
        # A power loss: the state was marked unsynced on boot 1, and the
        # host comes back on boot 2.
        (tmp_path / "n1" / unsynced.MARKER).write_text("boot-1\n")
        boot.write_text("boot-2\n")
        rebuilt = REGISTRY.get_sample_value("roadlog_states_rebuilt_total", {"group": "0"}) or 0
        after = Replica(cfg)
        await after.start()
        try:
            await _until(lambda: after.is_leader, "a leader after the power loss")
            now = REGISTRY.get_sample_value("roadlog_states_rebuilt_total", {"group": "0"})
            assert now == rebuilt + 1
            assert read_all(after) == want
        finally:
            await after.stop()

    asyncio.run(main())


def test_entries_retention_let_go_leave_the_log(tmp_path: Path) -> None:
    """The log keeps an entry only while the state refers to it: once
    retention removed a topic's batches, a compaction lets their entries go
    (without waiting for the log to grow by snapshot_bytes)."""
    addr = f"127.0.0.1:{free_port()}"
    cfg = NodeConfig(node_id=1, data_dir=tmp_path / "n1", listen=addr, peers={1: addr})
    spec = topics_pb2.TopicSpec(name="brief", region_geojson=REGION, partitions=2, retention_ms=300)
    create = command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))

    def kept(node: Replica) -> int:
        return sum(p.next_offset - p.first_offset for p in node.sm.describe("brief").partitions)

    async def main() -> None:
        node = Replica(cfg)
        appends = [
            append_op("brief", split_by_partition(pings(20, k * 20, 3), 2), 0, 0) for k in range(5)
        ]
        try:
            first_append, last_append = await _leader_with_pings(node, create, appends)
            assert node.log_store.retained_from() <= first_append
            assert node.sm.oldest_entry_ref() == first_append
            deadline = time.monotonic() + 15
            while kept(node):  # retention (300 ms) through the log, as the leader's trims do
                assert time.monotonic() < deadline, "retention never trimmed the pings"
                await asyncio.wait_for(node.propose_op(trim_op()), 10)
                await asyncio.sleep(0.05)
            assert node.sm.oldest_entry_ref() is None
            await _until(
                lambda: node.log_store.retained_from() > last_append,
                "the log to let the trimmed batches' entries go",
                timeout=30,
            )
            gauge = REGISTRY.get_sample_value("roadlog_raft_log_kept_from_index", {"group": "0"})
            assert gauge == node.log_store.retained_from()
        finally:
            await node.stop()

    asyncio.run(main())
