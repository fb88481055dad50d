"""A node that leads no group on its event loop writes its Raft log on
the loop itself (no thread hop), and so does a leader alone on its loop
whose proposals come one at a time; a leader whose proposals overlap, a
node whose loop runs a group another leads, a write while the log's thread
is busy (a compaction there) and a write too big keep the threads. Either
way the write is durable in LMDB before it is reported."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from node_daemon.config import NodeConfig
from node_daemon.raft import Entry, HardState, LogWrite
from node_daemon.raft.types import Role
from node_daemon.replica import replica as replica_module
from node_daemon.replica.replica import Replica
from roadlog.runtime.processes import free_port
from roadlog.v1 import command_pb2

pytestmark = pytest.mark.unit


def _node(tmp_path: Path, name: str = "n1") -> Replica:
    addr = f"127.0.0.1:{free_port()}"
    other = f"127.0.0.1:{free_port()}"
    cfg = NodeConfig(node_id=1, data_dir=tmp_path / name, listen=addr, peers={1: addr, 2: other})
    node = Replica(cfg)
    node._loop = asyncio.get_running_loop()
    return node


def _close(node: Replica) -> None:
    node._log_io.shutdown()
    node._apply_io.shutdown()
    node.sm.close()
    node.log_store.close()


def _write(first: int, n: int, size: int = 100) -> LogWrite:
    entries = [Entry(1, i, data=bytes([i % 256]) * size) for i in range(first, first + n)]
    return LogWrite(HardState(1, 0, 0), entries, None, True)


def _stored(node: Replica, lo: int, hi: int) -> list[Entry]:
    with node.log_store.env.begin() as txn:  # read from LMDB, not the recent cache
        assert txn.stat(node.log_store._log)["entries"] >= hi - lo
    return node.log_store.entries(lo, hi)


async def _reported(node: Replica, write: LogWrite) -> None:
    done = asyncio.Event()

    def write_done(w: LogWrite) -> None:
        if w is write:
            done.set()

    node.driver.write_done = write_done  # type: ignore[method-assign]
    await asyncio.wait_for(done.wait(), 10)


def test_a_follower_and_a_one_at_a_time_leader_write_on_the_loop(tmp_path: Path) -> None:
    async def main() -> None:
        node = _node(tmp_path)
        try:
            assert not node.is_leader
            handed = node._log_io._handed
            synced: list[bool] = []
            save = node.log_store.save

            def recorded(*args: Any) -> None:
                synced.append(args[3])
                save(*args)

            node.log_store.save = recorded  # type: ignore[method-assign,assignment]
            w = _write(1, 3)
            assert node._write_log(w) is True  # durable when it returns
            assert node._log_io._handed == handed  # no job for the log's thread
            assert synced == [True]  # fsynced before it is reported, as on the thread
            node.log_store.save = save  # type: ignore[method-assign]
            assert [e.data for e in _stored(node, 1, 4)] == [e.data for e in w.entries]

            # A leader whose proposals come one at a time writes on its loop
            # too; once one came while another was unanswered, on the thread.
            node.core.role = Role.LEADER
            node.log_store.save = recorded  # type: ignore[method-assign,assignment]
            w = _write(4, 1)
            assert node._write_log(w) is True  # durable when it returns
            assert node._log_io._handed == handed
            assert synced == [True, True]  # fsynced before it is reported
            node.log_store.save = save  # type: ignore[method-assign]
            assert [e.data for e in _stored(node, 4, 5)] == [e.data for e in w.entries]
            node._proposals_overlap = True
            w = _write(5, 2)
            assert node._write_log(w) is False  # on the thread, reported later
            await _reported(node, w)
            assert node._log_io._handed == handed + 1
            assert node.log_store.last_index() == 6
        finally:
            _close(node)

    asyncio.run(main())


def test_the_thread_when_the_loop_runs_a_leader_is_busy_or_the_write_is_big(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        node, mate = _node(tmp_path, "n1"), _node(tmp_path, "n2")
        try:
            # Another group on this loop leads: its work must not wait.
            node.loop_mates = [node, mate]
            mate.core.role = Role.LEADER
            w = _write(1, 1)
            assert node._write_log(w) is False
            await _reported(node, w)
            mate.core.role = Role.FOLLOWER

            # The log's thread is busy (a compaction): nothing beside it.
            gate = threading.Event()
            busy = node._log_io.submit(gate.wait, 10)
            w = _write(2, 1)
            assert node._write_log(w) is False
            gate.set()
            assert busy.result(10)
            await _reported(node, w)

            # Too big to hold the loop for.
            monkeypatch.setattr(replica_module, "FOLLOWER_INLINE_BYTES", 1000)
            w = _write(3, 1, size=2000)
            assert node._write_log(w) is False
            await _reported(node, w)
            assert node._write_log(_write(4, 1, size=500)) is True

            # A leader: beyond LEADER_INLINE_BYTES, or with another group on
            # its loop (a follower there would wait on its write), the thread.
            node.core.role = Role.LEADER
            monkeypatch.setattr(replica_module, "LEADER_INLINE_BYTES", 1000)
            w = _write(5, 1, size=2000)
            assert node._write_log(w) is False
            await _reported(node, w)
            w = _write(6, 1, size=500)
            assert node._write_log(w) is False
            await _reported(node, w)
            node.loop_mates = [node]
            assert node._write_log(_write(7, 1, size=500)) is True
            assert [e.index for e in _stored(node, 1, 8)] == [1, 2, 3, 4, 5, 6, 7]
        finally:
            _close(node)
            _close(mate)

    asyncio.run(main())


def test_a_leader_learns_whether_its_proposals_overlap(tmp_path: Path) -> None:
    """A proposal made while an earlier one is unanswered marks them as
    overlapping (the leader's writes go to the thread); one made when all
    were answered clears it."""

    async def main() -> None:
        addr = f"127.0.0.1:{free_port()}"
        cfg = NodeConfig(node_id=1, data_dir=tmp_path / "n1", listen=addr, peers={1: addr})
        node = Replica(cfg)
        node._loop = asyncio.get_running_loop()
        try:
            node.core.campaign()  # the only voter: leader at once
            assert node.is_leader
            loop = asyncio.get_running_loop()

            def propose() -> asyncio.Future[Any]:
                fut: asyncio.Future[Any] = loop.create_future()
                node._ops.append((command_pb2.Op(), fut, None))
                node._propose_ops()
                return fut

            propose()
            assert not node._proposals_overlap  # nothing else was unanswered
            propose()
            assert node._proposals_overlap  # the first is still unanswered
            node._fail_lost(node._pending.drain())  # both answered (as lost)
            propose()
            assert not node._proposals_overlap
        finally:
            _close(node)

    asyncio.run(main())
