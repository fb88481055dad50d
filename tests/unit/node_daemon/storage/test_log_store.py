"""A process's log store (``node_daemon.storage.log_store``, ``group_commit``,
``group_logs``): every group's Raft log in one LMDB environment, the saves
handed over in one turn of the event loop written in one transaction (one
fsync), one group's damage set aside without touching the others, and the
layout of one environment per group migrated at start."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from node_daemon.raft import Entry, HardState
from node_daemon.raft.types import ConfState, Snapshot, SnapshotMeta
from node_daemon.storage.group_commit import GroupCommit
from node_daemon.storage.group_logs import check_store, open_group_log
from node_daemon.storage.log_store import LogStore, store_dir
from node_daemon.storage.raft_log import LmdbLogStorage

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[4]


def ents(lo: int, hi: int, term: int = 1, size: int = 64, tag: int = 0) -> list[Entry]:
    return [Entry(term, i, data=(b"%d:%d:" % (tag, i)).ljust(size, b".")) for i in range(lo, hi)]


def txnid(store: LogStore) -> int:
    """LMDB's last committed write transaction: one per synced commit."""
    return int(store.env.info()["last_txnid"])


def test_one_turn_of_the_loop_writes_every_groups_entries_in_one_synced_transaction(
    tmp_path: Path,
) -> None:
    store = LogStore(tmp_path / "s")
    logs = {g: store.open(g) for g in (1, 2, 3)}
    commits = GroupCommit(store)
    before = txnid(store)

    async def turn(lo: int, hi: int) -> list[BaseException | None]:
        loop = asyncio.get_running_loop()
        done: list[asyncio.Future[BaseException | None]] = []
        for g, log in logs.items():  # every group hands its write over in one turn
            fut: asyncio.Future[BaseException | None] = loop.create_future()
            save = (log, HardState(1, 1, lo - 1), ents(lo, hi, tag=g), None)
            commits.submit(loop, save, g != 2, fut.set_result)  # group 2 not inline: the thread
            done.append(fut)
        return list(await asyncio.gather(*done))

    assert asyncio.run(turn(1, 11)) == [None, None, None]
    assert txnid(store) - before == 1 and store.commits == 1 and store.saves == 3
    assert asyncio.run(turn(11, 21)) == [None, None, None]
    assert txnid(store) - before == 2 and store.commits == 2 and store.saves == 6
    for g, log in logs.items():
        assert log.last_index() == 20 and log.entries(1, 21) == ents(1, 21, tag=g)
    store.close()
    again = LogStore(tmp_path / "s")  # on disk as the views said
    for g in (1, 2, 3):
        log = again.open(g)
        assert log.entries(1, 21) == ents(1, 21, tag=g)
        assert log.initial_state() == HardState(1, 1, 10) and log.verify() == 0
    again.close()


def test_writes_handed_over_while_one_is_in_flight_go_together_in_the_next(
    tmp_path: Path,
) -> None:
    store = LogStore(tmp_path / "s")
    logs = [store.open(g) for g in (1, 2, 3)]
    commits = GroupCommit(store)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[BaseException | None] = loop.create_future()
        commits.submit(loop, (logs[0], None, ents(1, 2), None), False, first.set_result)
        await asyncio.sleep(0)  # its flush begins on the store's thread
        rest = []
        for log in logs[1:]:
            fut: asyncio.Future[BaseException | None] = loop.create_future()
            commits.submit(loop, (log, None, ents(1, 2), None), False, fut.set_result)
            rest.append(fut)
        assert await first is None
        assert await asyncio.gather(*rest) == [None, None]

    asyncio.run(run())
    assert store.commits == 2 and store.saves == 3
    store.close()


def test_a_failed_commit_stores_no_group_and_tells_every_one(tmp_path: Path) -> None:
    store = LogStore(tmp_path / "s")
    a, b = store.open(1), store.open(2)
    commits = GroupCommit(store)

    async def run() -> list[BaseException | None]:
        loop = asyncio.get_running_loop()
        futs = []
        for log, first in ((a, 1), (b, 5)):  # b's entries leave a gap: the commit fails
            fut: asyncio.Future[BaseException | None] = loop.create_future()
            commits.submit(loop, (log, None, ents(first, first + 2), None), True, fut.set_result)
            futs.append(fut)
        return list(await asyncio.gather(*futs))

    results = asyncio.run(run())
    assert all(isinstance(r, Exception) and "gap" in str(r) for r in results)
    assert a.last_index() == 0 and b.last_index() == 0
    store.close()
    again = LogStore(tmp_path / "s")
    assert again.open(1).last_index() == 0 and again.open(2).last_index() == 0
    again.close()


def test_every_acknowledged_commit_of_every_group_survives_a_kill(tmp_path: Path) -> None:
    """A writer killed mid-batch: each group has every entry acknowledged
    to it, and the groups' logs are each a whole batch's (one transaction)."""
    code = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from node_daemon.raft import Entry
        from node_daemon.storage.group_commit import GroupCommit
        from node_daemon.storage.log_store import LogStore
        store = LogStore(Path({str(tmp_path / "s")!r}))
        logs = [store.open(g) for g in (1, 2, 3)]
        commits = GroupCommit(store)
        async def main():
            loop = asyncio.get_running_loop()
            i = 1
            while True:
                futs = []
                for log in logs:
                    fut = loop.create_future()
                    entries = [Entry(1, j, data=b"x" * 4000) for j in range(i, i + 5)]
                    commits.submit(loop, (log, None, entries, None), False, fut.set_result)
                    futs.append(fut)
                assert await asyncio.gather(*futs) == [None, None, None]
                i += 5
                print(i - 1, flush=True)
        asyncio.run(main())
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None
    acked = 0
    for line in proc.stdout:
        acked = int(line)
        if acked >= 200:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = LogStore(tmp_path / "s")
    lasts = {store.open(g).last_index() for g in (1, 2, 3)}
    assert len(lasts) == 1 and min(lasts) >= acked  # one transaction: all or none
    assert all(store.open(g).verify() == 0 for g in (1, 2, 3))
    store.close()


def _three_groups(data: Path) -> LogStore:
    store = LogStore(store_dir(data, "worker-0"))
    saves = [(store.open(g), HardState(2, 1, 50), ents(1, 51, tag=g), None) for g in (1, 2, 3)]
    store.commit(saves)
    return store


def test_one_groups_damaged_entry_is_set_aside_alone(tmp_path: Path) -> None:
    store = _three_groups(tmp_path)
    group_dir = tmp_path / "groups" / "2"
    (group_dir / "state").mkdir(parents=True)  # made from that log: it goes too
    log = store.open(2)
    with store.env.begin(write=True, db=log._log) as txn:  # the disk flips a byte
        key = (30).to_bytes(8, "big")
        raw = bytes(txn.get(key) or b"")
        txn.put(key, raw[:40] + bytes([raw[40] ^ 0xFF]) + raw[41:])
    before = {g: store.open(g).entries(1, 51) for g in (1, 3)}
    for g in (1, 3):
        log, why, _ = open_group_log(store, g, tmp_path / "groups" / str(g))
        assert why == "" and log.entries(1, 51) == before[g]
    log, why, kept = open_group_log(store, 2, group_dir)
    assert "entry 30" in why and kept == HardState(2, 1, 50)
    assert log.last_index() == 0 and log.initial_state() == HardState()
    [aside] = group_dir.glob("corrupt-*")
    assert "entry 30" in (aside / "why").read_text() and not (group_dir / "state").exists()
    copy = LmdbLogStorage(aside / "raft")  # the damaged records, for a post-mortem
    assert copy.last_index() == 50 and copy.verify() == 30
    copy.close()
    for g in (1, 3):  # untouched
        assert store.open(g).entries(1, 51) == before[g] and store.open(g).verify() == 0
    assert store.placed() == [1, 2, 3]
    with pytest.raises(Exception, match="no peer can catch"):
        log2 = store.open(3)
        with store.env.begin(write=True, db=log2._log) as txn:
            txn.put((5).to_bytes(8, "big"), b"junk")
        open_group_log(store, 3, tmp_path / "groups" / "3", can_catch_up=False)
    store.close()


def test_a_truncated_store_file_that_reads_whole_is_rewritten(tmp_path: Path) -> None:
    store = _three_groups(tmp_path)
    path = store.path
    store.close()
    size = (path / "data.mdb").stat().st_size
    with open(path / "data.mdb", "r+b") as f:
        f.truncate(size - 4096)  # pages LMDB counts but never wrote (a free tail)
    assert check_store(path, [tmp_path / "groups" / str(g) for g in (1, 2, 3)]) in ("",)
    again = LogStore(path)
    assert all(again.open(g).verify() == 0 and again.open(g).last_index() == 50 for g in (1, 2, 3))
    again.close()


def _legacy(group_dir: Path, tag: int) -> None:
    old = LmdbLogStorage(group_dir / "raft")
    snap = Snapshot(SnapshotMeta(10, 2, ConfState(frozenset({1, 2, 3}))), b"")
    old.save(HardState(3, 2, 40), [], snap)
    old.save(None, ents(11, 41, term=3, tag=tag))
    old.close()


def test_a_per_group_log_of_the_old_layout_is_migrated_into_the_store(tmp_path: Path) -> None:
    for g in (1, 2):
        _legacy(tmp_path / "groups" / str(g), g)
    (tmp_path / "groups" / "1" / "raft" / "catching-up").write_text("")  # stays where it was
    store = LogStore(store_dir(tmp_path, "main"))
    for g in (1, 2):
        group_dir = tmp_path / "groups" / str(g)
        log, why, _ = open_group_log(store, g, group_dir)
        assert why == "" and log.first_index() == 11 and log.last_index() == 40
        assert log.entries(11, 41) == ents(11, 41, term=3, tag=g)
        assert log.initial_state() == HardState(3, 2, 40) and log.snapshot().meta.index == 10
        assert not (group_dir / "raft" / "data.mdb").exists()
    assert (tmp_path / "groups" / "1" / "raft" / "catching-up").exists()
    assert store.placed() == [1, 2]
    # What another process reads of it (the main process, a backup).
    code = (
        "import sys; from pathlib import Path\n"
        "from node_daemon.storage.group_logs import GroupLogReader\n"
        "r = GroupLogReader(Path(sys.argv[1]), 1)\n"
        "print(r.read_slice(20, 2, 3).decode())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "groups" / "1")],
        capture_output=True, text=True, cwd=REPO, check=True,
    ).stdout.strip()  # fmt: skip
    assert out == ents(20, 21, term=3, tag=1)[0].data[2:5].decode()
    store.close()
    # A crash after the copy was marked, before the old files went: the
    # store's copy is the log, the old one is removed.
    _legacy(tmp_path / "groups" / "3", 3)
    store = LogStore(store_dir(tmp_path, "main"))
    store.adopt(3, LmdbLogStorage(tmp_path / "groups" / "3" / "raft"))
    store.commit([(store.open(3), HardState(3, 2, 41), ents(41, 42, term=3, tag=3), None)])
    log, why, _ = open_group_log(store, 3, tmp_path / "groups" / "3")
    assert why == "" and log.last_index() == 41
    assert not (tmp_path / "groups" / "3" / "raft" / "data.mdb").exists()
    store.close()


def test_a_group_moves_to_the_store_of_the_worker_it_now_runs_in(tmp_path: Path) -> None:
    first = _three_groups(tmp_path)  # all three in worker-0's store
    first.close()
    second = LogStore(store_dir(tmp_path, "worker-1"))  # two workers now: group 2 here
    log, why, _ = open_group_log(second, 2, tmp_path / "groups" / "2")
    assert why == "" and log.entries(1, 51) == ents(1, 51, tag=2)
    assert second.placed() == [2]
    second.close()
    first = LogStore(store_dir(tmp_path, "worker-0"))
    assert first.placed() == [1, 3]
    first.close()
