"""The LogStorage contract, checked on both the in-memory store and LMDB,
plus what only a disk can show: reopening, a SIGKILL mid-write, a full map
and a full disk."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from node_daemon.raft import (
    CompactedError,
    ConfState,
    CorruptLogError,
    Entry,
    EntryType,
    HardState,
    MemoryStorage,
    Snapshot,
    SnapshotMeta,
    StorageFullError,
    UnavailableError,
    bootstrap,
)
from node_daemon.storage.raft_log import LmdbLogStorage
from tests.conftest import small_tmpfs

pytestmark = pytest.mark.unit


def ents(lo: int, hi: int, term: int = 1, size: int = 8) -> list[Entry]:
    return [Entry(term, i, data=(b"%d:" % i).ljust(size, b".")) for i in range(lo, hi)]


# LMDB with its in-memory cache of recent entries: big enough for every
# entry of a test, none at all (every read from LMDB), and a few entries'
# worth (reads that start in LMDB and end in memory).
CACHES = {"lmdb": 32 << 20, "lmdb-uncached": 0, "lmdb-small-cache": 4 * 25}


@pytest.fixture(params=["memory", *CACHES])
def store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[MemoryStorage | LmdbLogStorage]:
    if request.param == "memory":
        yield MemoryStorage()
    else:
        s = LmdbLogStorage(tmp_path / "log", map_size=4 << 20, cache_bytes=CACHES[request.param])
        yield s
        s.close()


def test_lmdb_serves_recent_entries_from_memory_and_the_rest_from_disk(tmp_path: Path) -> None:
    s = LmdbLogStorage(tmp_path / "log", map_size=4 << 20, cache_bytes=5 * 25)
    s.save(HardState(1, 0, 0), ents(1, 21))
    cached = s.entries(16, 21)
    assert cached == ents(16, 21)
    assert all(a is b for a, b in zip(cached, s._recent.values(), strict=True))  # no copy
    assert s.entries(1, 21) == ents(1, 21)  # mostly from LMDB
    s.save(None, [Entry(2, 19, data=b"new 19")])  # truncates 19 and 20
    assert s.entries(15, 20) == [*ents(15, 19), Entry(2, 19, data=b"new 19")]
    assert s.last_index() == 19 and s.term(19) == 2 and sorted(s._recent) == [16, 17, 18, 19]
    s.compact(Snapshot(SnapshotMeta(17, 1, ConfState(frozenset({1}))), b""))
    assert sorted(s._recent) == [18, 19] and s.entries(18, 20)[0] == ents(18, 19)[0]
    s.close()


def test_empty_store(store: MemoryStorage | LmdbLogStorage) -> None:
    assert store.first_index() == 1 and store.last_index() == 0
    assert store.term(0) == 0
    assert store.initial_state() == HardState()
    with pytest.raises(UnavailableError):
        store.term(1)


def test_append_read_and_limits(store: MemoryStorage | LmdbLogStorage) -> None:
    store.save(HardState(1, 2, 3), ents(1, 11))
    assert store.last_index() == 10
    assert [e.index for e in store.entries(3, 7)] == [3, 4, 5, 6]
    assert store.entries(3, 7)[0].data.startswith(b"3:")
    # A byte limit cuts the batch but always returns at least one entry.
    assert len(store.entries(1, 11, max_bytes=1)) == 1
    assert len(store.entries(1, 11, max_bytes=3 * ents(1, 2)[0].size())) == 3
    assert store.initial_state() == HardState(1, 2, 3)
    with pytest.raises(UnavailableError):
        store.entries(5, 12)


def test_conflicting_suffix_is_truncated(store: MemoryStorage | LmdbLogStorage) -> None:
    store.save(None, ents(1, 11, term=1))
    store.save(None, ents(6, 8, term=2))
    assert store.last_index() == 7
    assert [store.term(i) for i in range(1, 8)] == [1] * 5 + [2, 2]


def test_gaps_are_refused(store: MemoryStorage | LmdbLogStorage) -> None:
    store.save(None, ents(1, 3))
    with pytest.raises(Exception, match="gap"):
        store.save(None, ents(5, 6))
    assert store.last_index() == 2


def test_compaction_drops_a_prefix(store: MemoryStorage | LmdbLogStorage) -> None:
    store.save(None, ents(1, 11, term=3))
    conf = ConfState(frozenset({1, 2, 3}))
    store.compact(Snapshot(SnapshotMeta(6, 3, conf), b"state"))
    assert store.first_index() == 7 and store.last_index() == 10
    assert store.term(6) == 3
    with pytest.raises(CompactedError):
        store.term(5)
    with pytest.raises(CompactedError):
        store.entries(6, 8)
    assert store.snapshot() == Snapshot(SnapshotMeta(6, 3, conf), b"state")
    assert [e.index for e in store.entries(7, 11)] == [7, 8, 9, 10]


def test_installing_a_snapshot_replaces_the_log(store: MemoryStorage | LmdbLogStorage) -> None:
    store.save(None, ents(1, 6))
    snap = Snapshot(SnapshotMeta(20, 4, ConfState(frozenset({1}))), b"s")
    store.save(HardState(4, 0, 20), [], snap)
    assert (store.first_index(), store.last_index()) == (21, 20)
    store.save(None, ents(21, 23, term=4))
    assert store.last_index() == 22 and store.term(20) == 4


def test_config_entries_follow_truncation_and_compaction(
    store: MemoryStorage | LmdbLogStorage,
) -> None:
    c1 = ConfState(frozenset({1, 2})).encode()
    c2 = ConfState(frozenset({1, 2, 3})).encode()
    store.save(
        None, [Entry(1, 1, EntryType.CONFIG, c1), *ents(2, 5), Entry(1, 5, EntryType.CONFIG, c2)]
    )
    assert [e.index for e in store.config_entries()] == [1, 5]
    store.save(None, ents(5, 6, term=2))  # overwrites the second one
    assert [e.index for e in store.config_entries()] == [1]
    store.compact(Snapshot(SnapshotMeta(2, 1, ConfState(frozenset({1, 2})))))
    assert store.config_entries() == []


def test_bootstrap_writes_a_committed_configuration(store: MemoryStorage | LmdbLogStorage) -> None:
    bootstrap(store, [1, 2, 3])
    [e] = store.config_entries()
    assert ConfState.decode(e.data).voters == {1, 2, 3}
    assert store.initial_state().commit == 1
    with pytest.raises(ValueError, match="not empty"):
        bootstrap(store, [1, 2, 3])


# ------------------------------------------------------------- LMDB only


def test_lmdb_reopens_with_everything_saved(tmp_path: Path) -> None:
    s = LmdbLogStorage(tmp_path / "log")
    s.save(HardState(5, 2, 7), ents(1, 101, term=5))
    s.compact(Snapshot(SnapshotMeta(40, 5, ConfState(frozenset({1, 2}))), b"snap"))
    s.close()
    r = LmdbLogStorage(tmp_path / "log")
    assert r.initial_state() == HardState(5, 2, 7)
    assert (r.first_index(), r.last_index()) == (41, 100)
    assert r.entries(41, 101) == ents(41, 101, term=5)
    assert r.snapshot().data == b"snap"
    r.close()


def test_lmdb_log_bytes_grow_with_entries_and_shrink_with_compaction(tmp_path: Path) -> None:
    s = LmdbLogStorage(tmp_path / "log")
    empty = s.log_bytes()
    s.save(HardState(1, 1, 0), ents(1, 201, size=20_000))  # ~4 MB, overflow pages
    full = s.log_bytes()
    assert full - empty >= 200 * 20_000
    s.compact(Snapshot(SnapshotMeta(150, 1, ConfState(frozenset({1}))), b"snap"))
    assert s.log_bytes() < full / 3  # 50 of the 200 entries are left
    s.close()


def test_lmdb_commit_only_saves_are_written_with_the_next_sync(tmp_path: Path) -> None:
    s = LmdbLogStorage(tmp_path / "log")
    s.save(HardState(1, 1, 0), ents(1, 3))
    s.save(HardState(1, 1, 2), [], sync=False)  # only the commit moved
    s.close()
    r = LmdbLogStorage(tmp_path / "log")
    assert r.initial_state() == HardState(1, 1, 0)  # lost, as allowed
    r.save(HardState(1, 1, 2), [], sync=False)
    r.save(None, ents(3, 4))
    r.close()
    assert LmdbLogStorage(tmp_path / "log").initial_state() == HardState(1, 1, 2)


def fill_until_full(path: Path, size: int, match: str, **open_args: Any) -> None:
    """Append until the store refuses; then every entry it accepted is there
    after reopening, and nothing else."""
    s = LmdbLogStorage(path, **open_args)
    i = 1
    with pytest.raises(StorageFullError, match=match):
        while i < 100_000:
            s.save(HardState(1, 0, i), ents(i, i + 10, size=size))
            i += 10
    last = s.last_index()
    assert last == i - 1 and last > 10
    s.close()
    r = LmdbLogStorage(path, map_size=open_args["map_size"] * 2)
    assert r.last_index() == last
    assert r.entries(1, last + 1) == ents(1, last + 1, size=size)
    r.close()


def test_lmdb_full_map_is_a_clear_error_and_keeps_what_was_stored(tmp_path: Path) -> None:
    fill_until_full(tmp_path / "log", 1000, "map full", map_size=256 << 10, max_map_size=512 << 10)


def test_lmdb_full_map_grows_when_allowed(tmp_path: Path) -> None:
    s = LmdbLogStorage(tmp_path / "log", map_size=128 << 10, max_map_size=64 << 20)
    s.save(None, ents(1, 2001, size=1000))
    assert s.last_index() == 2000
    assert s.env.info()["map_size"] > 128 << 10
    s.close()


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: a real full disk, not a simulated one."""
    with small_tmpfs(tmp_path / "tiny", "2m", "the full-disk test") as mnt:
        yield mnt


def test_lmdb_full_disk_is_a_clear_error_and_keeps_what_was_stored(tiny_disk: Path) -> None:
    fill_until_full(tiny_disk / "log", 2000, "disk full", map_size=64 << 20)


WRITER = textwrap.dedent(
    """
    import sys
    from node_daemon.raft import Entry, HardState
    from node_daemon.storage.raft_log import LmdbLogStorage
    s = LmdbLogStorage(sys.argv[1])
    i = s.last_index() + 1
    term = int(sys.argv[2])
    while True:
        batch = [Entry(term, j, data=b"%d-%d" % (term, j) * 20) for j in range(i, i + 50)]
        s.save(HardState(term, 1, i - 1), batch)
        print(i + 49, flush=True)
        i += 50
    """
)


@pytest.mark.parametrize("round_", range(3))
def test_lmdb_survives_sigkill_mid_write(tmp_path: Path, round_: int) -> None:
    """A writer is SIGKILLed at a random moment; every save it reported is
    there after reopening, and the log is contiguous and readable."""
    path = str(tmp_path / "log")
    reported = 0
    for term in range(1, 4):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, path, str(term)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[4])},
        )
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        target = 5 + (round_ * 7 + term * 3) % 11
        lines = 0
        while lines < target and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            reported = int(line)
            lines += 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert lines == target, "the writer did not make progress"
        s = LmdbLogStorage(path)
        last = s.last_index()
        assert last >= reported
        got = s.entries(1, last + 1)
        assert [e.index for e in got] == list(range(1, last + 1))
        for e in got:
            assert e.data == b"%d-%d" % (e.term, e.index) * 20
        s.close()


def _rewrite(store: LmdbLogStorage, index: int, change: Callable[[bytes], bytes | None]) -> None:
    """Change (or, for None, delete) an entry's stored bytes behind the
    store's back, as a disk might."""
    key = index.to_bytes(8, "big")
    with store.env.begin(write=True, db=store._log) as txn:
        new = change(bytes(txn.get(key) or b""))
        if new is None:
            txn.delete(key)
        else:
            txn.put(key, new)


def _flip_last(raw: bytes) -> bytes:
    return raw[:-1] + bytes([raw[-1] ^ 0x01])


def test_lmdb_entries_carry_a_checksum_that_catches_a_changed_byte(tmp_path: Path) -> None:
    s = LmdbLogStorage(tmp_path / "log", cache_bytes=0)  # every read goes to LMDB
    s.save(HardState(term=1), ents(1, 11, size=64))
    assert s.verify() == 0
    _rewrite(s, 7, _flip_last)
    assert s.verify() == 7
    with pytest.raises(CorruptLogError) as err:
        s.entries(5, 9)
    assert err.value.index == 7
    with pytest.raises(CorruptLogError):
        s.term(7)
    assert [e.index for e in s.entries(1, 7)] == list(range(1, 7))  # the sound ones still read
    s.close()


def test_lmdb_a_missing_entry_is_corruption(tmp_path: Path) -> None:
    s = LmdbLogStorage(tmp_path / "log", cache_bytes=0)
    s.save(HardState(term=1), ents(1, 11))
    _rewrite(s, 4, lambda raw: None)
    assert s.verify() == 4
    with pytest.raises(CorruptLogError):
        s.entries(2, 6)
    s.close()


def test_lmdb_an_entry_stored_under_another_index_is_corruption(tmp_path: Path) -> None:
    s = LmdbLogStorage(tmp_path / "log", cache_bytes=0)
    s.save(HardState(term=1), ents(1, 11))
    with s.env.begin(db=s._log) as txn:
        five = bytes(txn.get((5).to_bytes(8, "big")) or b"")
    _rewrite(s, 6, lambda raw: five)  # the same bytes, but the checksum covers the index
    assert s.verify() == 6
    s.close()


def _old_log(path: Path, entries: list[Entry]) -> LmdbLogStorage:
    """A log whose ``entries`` were written as the release before checksums
    wrote them, opened again (no cache: every read goes to LMDB)."""
    s = LmdbLogStorage(path, cache_bytes=0)
    with s.env.begin(write=True, db=s._log) as txn:
        for e in entries:
            txn.put(e.index.to_bytes(8, "big"), struct.pack(">QB", e.term, int(e.type)) + e.data)
    s.close()
    return LmdbLogStorage(path, cache_bytes=0)


def _without_flag(raw: bytes) -> bytes:
    """The record with its type byte's checksum flag cleared."""
    return raw[:8] + bytes([raw[8] & 0x7F]) + raw[9:]


def test_lmdb_reads_entries_written_before_the_checksum(tmp_path: Path) -> None:
    again = _old_log(tmp_path / "log", ents(1, 6))
    again.save(HardState(term=1), ents(6, 9))
    assert again.verify() == 0
    assert [e.data for e in again.entries(1, 9)] == [e.data for e in ents(1, 9)]
    # From the first entry written with a checksum on, one without is corrupt:
    # its flag bit flipped would otherwise hide a changed byte.
    _rewrite(again, 7, _without_flag)
    assert again.verify() == 7
    again.close()
    assert LmdbLogStorage(tmp_path / "log").verify() == 7  # the boundary is kept


@pytest.mark.parametrize("cut", [0, 5, 12, 13, 16])
def test_lmdb_a_record_cut_short_is_corruption_not_a_crash(tmp_path: Path, cut: int) -> None:
    """Whatever bytes a record holds, reading it gives the entry or
    CorruptLogError (a node's start sets such a log aside)."""
    s = LmdbLogStorage(tmp_path / "log", cache_bytes=0)
    s.save(HardState(term=1), ents(1, 4, size=32))
    _rewrite(s, 2, lambda raw: raw[:cut])
    assert s.verify() == 2
    with pytest.raises(CorruptLogError):
        s.entries(1, 4)
    s.close()


def test_lmdb_a_configuration_copy_that_differs_is_corruption(tmp_path: Path) -> None:
    s = LmdbLogStorage(tmp_path / "log", cache_bytes=0)
    bootstrap(s, [1, 2, 3])
    s.save(HardState(term=1, commit=1), ents(2, 5))
    assert s.verify() == 0
    with s.env.begin(write=True, db=s._conf) as txn:
        txn.put((1).to_bytes(8, "big"), ConfState(frozenset({1, 2, 4})).encode())
    assert s.verify() == 1
    s.close()


def test_lmdb_a_rewritten_suffix_of_an_old_log_keeps_its_checksums_checked(
    tmp_path: Path,
) -> None:
    """Entries of an older log rewritten (a conflicting suffix cut) carry
    checksums: the boundary moves down to them, so one whose flag bit
    flips is still caught."""
    again = _old_log(tmp_path / "log", ents(1, 8))
    again.save(HardState(term=2), ents(4, 6, term=2))  # cuts 4..7, writes 4..5
    _rewrite(again, 4, _without_flag)
    assert again.verify() == 4
    again.close()
