"""The Raft log, hard state and latest snapshot in LMDB (the LogStorage contract).

Group 0's log in an LMDB environment of its own, separate from the state
machine's; a data group's in its process's log store (``log_store``: the
same layout in named databases of its own, ``<g>/log`` and so on, and the
saves of several groups in one transaction, ``save_in``). Layout (named
databases):

- ``log``:  8-byte big-endian index -> term (8 bytes), type (1 byte),
  checksum (8 bytes: xxh3-64), data. The checksum covers the index, term,
  type and data, so an entry the disk corrupted, or found under another
  index, is caught when it is read from LMDB (``CorruptLogError``);
  ``verify`` reads them all. Logs written before it lack the checksum:
  their type byte has no ``_CHECKED`` bit, and they are read as before;
  ``crc_from`` in ``meta`` is the first index written with one, from which
  an entry without it is corrupt too (its flag bit flipped).
- ``conf``: index -> encoded ConfState, for the CONFIG entries still in ``log``
- ``meta``: ``hard`` -> term, vote, commit; ``snap`` -> snapshot metadata;
  ``snapdata`` -> the snapshot's opaque data; ``retain`` -> the lowest index
  whose entry is still kept

Entries the state machine refers to (ping batches it stores as a reference
into the entry that carried them, docs/one-copy.md) outlive the compaction
point: ``compact(snapshot, retain_from)`` keeps every entry from
``retain_from`` on. Those below ``first_index()`` are no longer part of the
Raft log (``entries`` and ``term`` treat them as compacted); they are only
read by ``read_slice``. Invariant: the kept entries are contiguous, from
``retained_from()`` to ``last_index()``.

The entries saved last (up to ``cache_bytes``) are also kept in memory, so
that applying them and sending them to followers reads no LMDB page and
copies nothing: an entry is served from there only once its transaction
committed, and the entries a save truncates leave it first.

Every ``save`` is one write transaction, so it is atomic; with ``sync=True``
it is fsynced before it returns (group commit: one fsync for everything a
Ready asks to persist). A save that only moves the commit index is kept in
memory and written with the next synced save: a lost commit index is
re-learned from the leader and never needed for safety.

A full map is grown (doubling, up to ``max_map_size``); past that, or when
the disk is full, ``StorageFullError`` is raised and the transaction is
aborted, so nothing stored before is touched.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lmdb
from xxhash import xxh3_64_intdigest

from node_daemon.raft.errors import (
    CompactedError,
    CorruptLogError,
    MissingEntryError,
    StorageError,
    StorageFullError,
    UnavailableError,
)
from node_daemon.raft.types import (
    ConfState,
    Entry,
    EntryType,
    HardState,
    Snapshot,
    SnapshotMeta,
)
from node_daemon.storage import kept_log
from node_daemon.storage.disk import data_file_identity, full_disk_error, open_lmdb
from roadlog import round_trace

_KEY = struct.Struct(">Q")
_HDR = struct.Struct(">QB")
_SUM = struct.Struct(">Q")
_CHECKED = 0x80  # in the type byte: a checksum follows the header
_BODY = _HDR.size + _SUM.size  # where a checked entry's data starts
_TYPES = frozenset(int(t) for t in EntryType)
_HARD = struct.Struct(">QQQ")
_SNAP = struct.Struct(">QQ")

GiB = 1 << 30
LOG_DBS = (b"log", b"conf", b"meta")  # a log's named databases in its own environment
MAX_RECENT = 1 << 16  # entries kept in memory, at most (and cache_bytes)


def _key(index: int) -> bytes:
    return _KEY.pack(index)


def _checksum(index: int, term: int, typ: int, data: bytes) -> int:
    """xxh3-64 of the data, seeded with one of the index, term and type."""
    return int(xxh3_64_intdigest(data, seed=xxh3_64_intdigest(_key(index) + _HDR.pack(term, typ))))


def encode_entry(e: Entry) -> bytes:
    """An entry's stored value: header, checksum, data."""
    total = _checksum(e.index, e.term, int(e.type), e.data)
    return _HDR.pack(e.term, int(e.type) | _CHECKED) + _SUM.pack(total) + e.data


def decode_entry(index: int, raw: bytes | memoryview, crc_from: int = 1) -> Entry:
    """The entry stored under ``index``; ``CorruptLogError`` if its checksum
    is not its content's, it has none at or after ``crc_from``, or it is
    too short to hold its header (never another error: a node reading a
    damaged log sets it aside rather than dying)."""
    if len(raw) < _HDR.size:
        raise CorruptLogError(f"entry {index} is corrupt ({len(raw)} bytes)", index)
    term, typ = _HDR.unpack_from(raw)
    if typ & _CHECKED and len(raw) < _BODY:
        raise CorruptLogError(f"entry {index} is corrupt ({len(raw)} bytes)", index)
    if not typ & _CHECKED:
        if index >= crc_from or typ not in _TYPES:
            raise CorruptLogError(f"entry {index} is corrupt (it has no checksum)", index)
        return Entry(term, index, EntryType(typ), bytes(raw[_HDR.size :]))
    data = bytes(raw[_BODY:])
    typ &= ~_CHECKED
    if _checksum(index, term, typ, data) != _SUM.unpack_from(raw, _HDR.size)[0]:
        raise CorruptLogError(f"entry {index} is corrupt (its checksum differs)", index)
    try:
        kind = EntryType(typ)
    except ValueError:  # pragma: no cover - a checksum that matches a bad type
        raise CorruptLogError(f"entry {index} has no known type ({typ})", index) from None
    return Entry(term, index, kind, data)


def encode_snapshot_meta(meta: SnapshotMeta) -> bytes:
    return _SNAP.pack(meta.index, meta.term) + meta.conf.encode()


def decode_snapshot_meta(raw: bytes) -> SnapshotMeta:
    index, term = _SNAP.unpack_from(raw)
    return SnapshotMeta(index, term, ConfState.decode(raw[_SNAP.size :]))


def entry_slice(raw: Any, index: int, offset: int, length: int) -> bytes:
    """``length`` bytes of a stored entry value's data from ``offset`` on
    (its checksum not checked); ``MissingEntryError`` if it is shorter."""
    body = _BODY if len(raw) > _HDR.size and raw[_HDR.size - 1] & _CHECKED else _HDR.size
    if len(raw) < body + offset + length:
        raise MissingEntryError(f"entry {index} is shorter than a batch it holds", index)
    return bytes(raw[body + offset : body + offset + length])


def _import_carried(txn: Any, log_db: Any, snapshot: Snapshot) -> int | None:
    """Put the log entries the snapshot's file carries (``kept_log``) into
    ``log_db``; the lowest of them, None if it carries none (or its data
    names no file)."""
    try:
        path = Path(snapshot.data.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not snapshot.data or not path.is_absolute():
        return None
    return kept_log.import_kept(txn, log_db, path)


def _is_disk_full(err: lmdb.Error, path: Path) -> bool:
    """ENOSPC, LMDB's disk error, or a write cut short by the disk filling
    (which LMDB reports as EIO): see ``full_disk_error``."""
    return isinstance(err, lmdb.DiskError) or full_disk_error(err, path)


class LmdbLogStorage:
    """LogStorage on LMDB. One instance per environment; single writer."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        map_size: int = 1 * GiB,
        max_map_size: int = 256 * GiB,
        cache_bytes: int = 32 << 20,
        *,
        env: lmdb.Environment | None = None,
        names: tuple[bytes, bytes, bytes] = LOG_DBS,
    ) -> None:
        """A log in its own environment in ``path``; or, given ``env`` (a
        ``LogStore``'s, in ``path``), one group's log in that shared
        environment, in the named databases ``names`` (log, conf, meta),
        which the store creates, writes in batches and closes."""
        self.path = Path(path)
        self.max_map_size = max(map_size, max_map_size)
        self._owns_env = env is None
        if env is None:
            self.path.mkdir(parents=True, exist_ok=True)
            env = open_lmdb(  # a full disk: StorageFullError, not a SIGBUS
                self.path,
                "log",
                map_size=map_size,
                max_dbs=4,
                sync=True,
                metasync=True,
                readahead=False,
            )
        self.env = env
        self.names = names
        self._log = self.env.open_db(names[0])
        self._conf = self.env.open_db(names[1])
        self._meta = self.env.open_db(names[2])
        with self.env.begin() as txn:
            raw = txn.get(b"hard", db=self._meta)
            self._hard = HardState(*_HARD.unpack(raw)) if raw else HardState()
            raw = txn.get(b"snap", db=self._meta)
            self._snap_meta = decode_snapshot_meta(raw) if raw else SnapshotMeta()
            cur = txn.cursor(db=self._log)
            self._last = _KEY.unpack(cur.key())[0] if cur.last() else self._snap_meta.index
            raw = txn.get(b"crc_from", db=self._meta)
            kept = txn.get(b"retain", db=self._meta)
        # The lowest index whose entry is kept (below the snapshot's: entries
        # the state still refers to).
        self._retain_from: int = _KEY.unpack(kept)[0] if kept else self._snap_meta.index + 1
        # Entries from here on carry a checksum (kept with the first save of
        # a log written before entries had one).
        self._crc_from: int = _KEY.unpack(raw)[0] if raw else self._last + 1
        self._crc_from_saved = raw is not None
        # The entries saved last, by index, in index order (written by the
        # saving thread after each commit; read by any: a miss reads LMDB).
        self._recent: dict[int, Entry] = {}
        self._recent_bytes = 0
        self._cache_bytes = cache_bytes

    # -- reads ---------------------------------------------------------------

    def initial_state(self) -> HardState:
        return self._hard

    def snapshot(self) -> Snapshot:
        with self.env.begin() as txn:
            data = txn.get(b"snapdata", db=self._meta) or b""
        return Snapshot(self._snap_meta, bytes(data))

    def first_index(self) -> int:
        return self._snap_meta.index + 1

    def retained_from(self) -> int:
        """The lowest index whose entry is kept: ``first_index()``, or below
        it where compaction kept entries the state refers to."""
        return min(self._retain_from, self._snap_meta.index + 1)

    def log_bytes(self) -> int:
        """Bytes the entries after the snapshot take (their share of the
        LMDB pages of every kept entry, by count): what compacting the whole
        log would free, besides the entries kept for the state."""
        with self.env.begin() as txn:
            st = txn.stat(self._log)
        total = int(st["psize"] * (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]))
        kept = self._last - self.retained_from() + 1
        live = self._last - self._snap_meta.index
        return total if kept <= 0 or live >= kept else total * max(live, 0) // kept

    def read_slice(self, index: int, offset: int, length: int) -> bytes:
        """``length`` bytes of entry ``index``'s data from ``offset`` on (a
        ping batch the state machine refers to), copied out of LMDB with no
        copy of the rest of the entry. ``MissingEntryError`` if the entry is
        not kept, or is shorter. The entry's checksum is not checked here
        (``verify`` does, for the whole log)."""
        e = self._recent.get(index)
        if e is not None and offset + length <= len(e.data):
            return e.data[offset : offset + length]
        with self.env.begin(db=self._log, buffers=True) as txn:
            raw = txn.get(_key(index))
            if raw is None:
                raise MissingEntryError(
                    f"entry {index} is not kept (kept from {self.retained_from()})", index
                )
            return entry_slice(raw, index, offset, length)

    def last_index(self) -> int:
        return self._last

    def term(self, index: int) -> int:
        snap = self._snap_meta
        if index < snap.index:
            raise CompactedError(f"index {index} is compacted (first {snap.index + 1})")
        if index == snap.index:
            return snap.term
        if index > self._last:
            raise UnavailableError(f"index {index} is beyond the last {self._last}")
        e = self._recent.get(index)
        if e is not None:
            return e.term
        with self.env.begin(db=self._log) as txn:
            raw = txn.get(_key(index))
            if raw is None:
                raise CorruptLogError(f"entry {index} missing from the log", index)
            return int(decode_entry(index, raw, self._crc_from).term)

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        if lo <= self._snap_meta.index:
            raise CompactedError(f"index {lo} is compacted (first {self.first_index()})")
        if hi > self._last + 1:
            raise UnavailableError(f"index {hi - 1} is beyond the last {self._last}")
        out: list[Entry] = []
        total = 0
        recent = self._recent
        for index in range(lo, hi):
            e = recent.get(index)
            if e is None:
                break
            total += e.size()
            if out and max_bytes is not None and total > max_bytes:
                return out
            out.append(e)
        else:
            return out
        out, total = [], 0  # not all in memory: read them all from LMDB
        with self.env.begin(db=self._log) as txn:
            cur = txn.cursor()
            if not cur.set_key(_key(lo)):
                raise CorruptLogError(f"entry {lo} missing from the log", lo)
            expect = lo
            for k, v in cur.iternext():
                index = _KEY.unpack(k)[0]
                if index >= hi:
                    break
                if index != expect:
                    raise CorruptLogError(f"entry {expect} missing from the log", expect)
                expect += 1
                e = decode_entry(index, v, self._crc_from)
                total += e.size()
                if out and max_bytes is not None and total > max_bytes:
                    break
                out.append(e)
        return out

    def verify(self) -> int:
        """Read every entry the log keeps from LMDB and check it (and each
        configuration's copy in ``conf``): the first index that is corrupt
        or missing, 0 when all are sound. Entries kept below the snapshot
        are checked too: the state reads its batches from them."""
        expect = self.retained_from()
        first_raft = self._snap_meta.index + 1  # below: kept for the state only
        with self.env.begin(db=self._log) as txn:
            cur = txn.cursor()
            for k, v in cur.iternext() if cur.set_range(_key(expect)) else ():
                index: int = _KEY.unpack(k)[0]
                if index != expect:
                    return expect
                try:
                    e = decode_entry(index, v, self._crc_from)
                except CorruptLogError:
                    return index
                # A configuration is read back from ``conf``: it must be the
                # checked entry's (that table carries no checksum of its own).
                if (
                    index >= first_raft
                    and e.type == EntryType.CONFIG
                    and txn.get(k, db=self._conf) != e.data
                ):
                    return index
                expect += 1
        return 0 if expect == self._last + 1 else expect

    def copy_records(self, dest: Path) -> None:
        """Write every record of this log (entries, configurations, hard
        state and snapshot records) into a new LMDB file in ``dest``,
        durably: a file that holds only what this log's trees reach (not
        LMDB's free list, nor pages it never wrote)."""
        dst = lmdb.open(str(dest), max_dbs=4, map_size=self.env.info()["map_size"])
        try:
            with self.env.begin() as rt, dst.begin(write=True) as wt:
                self.copy_into(rt, wt, dst, LOG_DBS)
            dst.sync(True)
        finally:
            dst.close()

    def copy_into(
        self, rt: Any, wt: Any, dst: lmdb.Environment, names: tuple[bytes, bytes, bytes]
    ) -> None:
        """Put every record of this log (read in ``rt``) into the named
        databases ``names`` of ``dst`` (in its write transaction ``wt``),
        which must be empty: a log moved to another environment as it is."""
        for name, db in zip(names, (self._log, self._conf, self._meta), strict=True):
            out = wt.cursor(db=dst.open_db(name, txn=wt))
            out.putmulti(rt.cursor(db=db).iternext(), append=True)

    def bundle(self, state_file: Path, dest: Path, upto: int) -> None:
        """Write ``dest``: the state snapshot ``state_file`` with every entry
        this log keeps up to ``upto`` (``kept_log.bundle``);
        ``MissingEntryError`` if one of them is gone meanwhile."""
        kept_log.bundle(state_file, dest, self.env, self._log, self.retained_from(), upto)

    def config_entries(self) -> list[Entry]:
        out: list[Entry] = []
        with self.env.begin(db=self._conf) as txn:
            for k, v in txn.cursor():
                index = _KEY.unpack(k)[0]
                out.append(Entry(self.term(index), index, EntryType.CONFIG, bytes(v)))
        return out

    # -- writes --------------------------------------------------------------

    @staticmethod
    def writes(entries: Sequence[Entry], snapshot: Snapshot | None, sync: bool) -> bool:
        """Does ``save`` with these touch the disk? Not when only the commit
        index moved (no entries, no snapshot, no sync asked): then it just
        remembers the hard state, and callers may skip a thread hop."""
        return bool(entries) or snapshot is not None or sync

    def save(
        self,
        hard_state: HardState | None,
        entries: Sequence[Entry],
        snapshot: Snapshot | None = None,
        sync: bool = True,
    ) -> None:
        hard = hard_state if hard_state is not None else self._hard
        if not self.writes(entries, snapshot, sync):
            self._hard = hard  # only the commit index moved: written with the next sync
            return
        round_trace.mark("log0")
        self._write(lambda txn: self.save_in(txn, hard, entries, snapshot))
        round_trace.mark("log1")

    def save_in(
        self,
        txn: Any,
        hard_state: HardState | None,
        entries: Sequence[Entry],
        snapshot: Snapshot | None = None,
    ) -> Callable[[], None]:
        """``save``'s records put in ``txn``, a write transaction of this
        log's environment that the caller commits (with other groups'
        saves: ``LogStore.commit``); returns what updates this log's view,
        to be called once, only after that commit."""
        hard = hard_state if hard_state is not None else self._hard
        view = self._save_txn(txn, hard, entries, snapshot)

        def commit_view() -> None:
            view()
            self._hard = hard

        return commit_view

    def _save_txn(
        self, txn: Any, hard: HardState, entries: Sequence[Entry], snapshot: Snapshot | None
    ) -> Callable[[], None]:
        snap_meta, last, retain = self._snap_meta, self._last, self._retain_from
        if snapshot is not None:
            txn.drop(self._log, delete=False)
            txn.drop(self._conf, delete=False)
            txn.put(b"snap", encode_snapshot_meta(snapshot.meta), db=self._meta)
            txn.put(b"snapdata", snapshot.data, db=self._meta)
            # The entries a snapshot carries for its state (kept_log) are
            # the new log's kept ones.
            carried = _import_carried(txn, self._log, snapshot)
            retain = snapshot.meta.index + 1 if carried is None else carried
            txn.put(b"retain", _key(retain), db=self._meta)
            snap_meta, last = snapshot.meta, snapshot.meta.index
        ents = [e for e in entries if e.index > snap_meta.index]
        if ents:
            first = ents[0].index
            if first > last + 1:
                raise StorageError(f"gap: appending {first} after {last}")
            if first <= last:
                self._delete_from(txn, self._log, first)
                self._delete_from(txn, self._conf, first)
            rows = [(_key(e.index), encode_entry(e)) for e in ents]
            cur = txn.cursor(db=self._log)
            cur.putmulti(rows, append=True)
            for e in ents:
                if e.type == EntryType.CONFIG:
                    txn.put(_key(e.index), e.data, db=self._conf)
            last = ents[-1].index
        txn.put(b"hard", _HARD.pack(hard.term, hard.vote, hard.commit), db=self._meta)
        # Every entry written here has a checksum: an older log's boundary
        # moves down to the first of them (a rewritten suffix, or a log that
        # a snapshot replaced), so that none of them can lose it unnoticed.
        crc_from = self._crc_from
        if snapshot is not None:
            crc_from = min(crc_from, snap_meta.index + 1)
        if ents:
            crc_from = min(crc_from, ents[0].index)
        if not self._crc_from_saved or crc_from != self._crc_from:
            txn.put(b"crc_from", _key(crc_from), db=self._meta)

        def commit_view() -> None:
            self._crc_from_saved = True
            self._crc_from = crc_from
            if snapshot is not None:
                self._recent.clear()
                self._recent_bytes = 0
                self._retain_from = retain
            elif entries and entries[0].index <= self._last:
                first = entries[0].index  # a truncated suffix leaves before its replacement
                self._forget_recent(lambda i: i >= first)
            for e in entries:
                if e.index > snap_meta.index:
                    self._recent[e.index] = e
                    self._recent_bytes += e.size()
            while self._recent and (
                self._recent_bytes > self._cache_bytes or len(self._recent) > MAX_RECENT
            ):
                oldest = next(iter(self._recent))
                self._recent_bytes -= self._recent.pop(oldest).size()
            self._snap_meta, self._last = snap_meta, last

        return commit_view

    def _forget_recent(self, which: Callable[[int], bool]) -> None:
        for i in [i for i in self._recent if which(i)]:
            self._recent_bytes -= self._recent.pop(i).size()

    @staticmethod
    def _delete_from(txn: Any, db: Any, first: int) -> None:
        cur = txn.cursor(db=db)
        if cur.set_range(_key(first)):
            while cur.delete():
                pass

    def compact(self, snapshot: Snapshot, retain_from: int | None = None) -> None:
        """Make ``snapshot`` the log's compaction point: the entries up to
        its index leave the Raft log. Those from ``retain_from`` on are kept
        (the state refers to them: ``read_slice``), the others deleted;
        ``retain_from`` None keeps none of them. What is kept never shrinks
        back: entries deleted before are not brought back."""
        index = snapshot.meta.index
        if index <= self._snap_meta.index:
            return
        if index > self._last:
            raise UnavailableError(f"compact {index} beyond the last {self._last}")
        keep = index + 1 if retain_from is None else min(max(retain_from, 1), index + 1)
        keep = max(keep, self.retained_from())

        def body(txn: Any) -> Callable[[], None]:
            for db, upto in ((self._log, keep - 1), (self._conf, index)):
                cur = txn.cursor(db=db)
                if cur.first():
                    while cur.key() and _KEY.unpack(cur.key())[0] <= upto:
                        if not cur.delete():
                            break
            txn.put(b"snap", encode_snapshot_meta(snapshot.meta), db=self._meta)
            txn.put(b"snapdata", snapshot.data, db=self._meta)
            txn.put(b"retain", _key(keep), db=self._meta)

            def commit_view() -> None:
                self._snap_meta = snapshot.meta
                self._retain_from = keep
                self._forget_recent(lambda i: i <= index)

            return commit_view

        self._write(body)

    def _write(self, body: Callable[[Any], Callable[[], None]]) -> None:
        write_txn(self.env, self.path, self.max_map_size, body)

    def close(self) -> None:
        """Close the environment if it is this log's own (a store's is the
        store's to close)."""
        if self._owns_env:
            self.env.close()


def write_txn(
    env: lmdb.Environment,
    path: Path,
    max_map_size: int,
    body: Callable[[Any], Callable[[], None]],
) -> None:
    """Run ``body(txn)`` in one synced write transaction of ``env`` (in
    ``path``), growing the map (doubling, up to ``max_map_size``) when it
    is full. ``body`` returns what updates the in-memory views, which runs
    only once the transaction committed; a transaction that failed left
    nothing behind (``StorageFullError`` for want of room)."""
    while True:
        try:
            with env.begin(write=True) as txn:
                on_commit = body(txn)
        except lmdb.MapFullError:
            size = env.info()["map_size"]
            if size * 2 > max_map_size:
                raise StorageFullError(
                    f"LMDB map full at {size} bytes (max_map_size {max_map_size})"
                ) from None
            env.set_mapsize(size * 2)
            continue
        except lmdb.Error as e:
            if _is_disk_full(e, path):
                raise StorageFullError(f"disk full writing {path}: {e}") from e
            raise StorageError(f"LMDB write failed in {path}: {e}") from e
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StorageFullError(f"disk full writing {path}: {e}") from e
            raise
        on_commit()
        return


class LogReader:
    """Read-only access to a group's Raft log from another process (the
    node's main process reading a worker's group): ``read_slice`` as
    ``LmdbLogStorage``'s. LMDB's readers span processes; a map the writer
    grew is adopted on the next read, and a log set aside and made anew
    under the same path (a damaged one, ``damage.py``) is opened again.
    ``db``: the log's named database (a group's in a ``LogStore``: its
    entries dropped there, the next read opens it again)."""

    def __init__(self, path: Path, db: bytes = LOG_DBS[0], max_dbs: int = 4) -> None:
        self.path = path
        self._name, self._max_dbs = db, max_dbs
        self._env: lmdb.Environment | None = None
        self._db: Any = None
        self._file: tuple[int, int] | None = None  # (device, inode) of the open data file

    def _open(self) -> lmdb.Environment:
        ident = data_file_identity(self.path)
        if self._env is not None and ident != self._file:
            self.close()  # another log under this path now
        if self._env is None:
            try:
                env = lmdb.open(
                    str(self.path), readonly=True, max_dbs=self._max_dbs, readahead=False
                )
            except lmdb.Error as e:
                raise MissingEntryError(f"the log in {self.path} is not readable: {e}", 0) from e
            try:
                self._db = env.open_db(self._name, create=False)
            except lmdb.Error as e:
                env.close()
                raise MissingEntryError(f"the log in {self.path} has no entries: {e}", 0) from e
            self._env, self._file = env, ident
        return self._env

    def read_slice(self, index: int, offset: int, length: int) -> bytes:
        env = self._open()
        for _ in range(2):
            try:
                with env.begin(db=self._db, buffers=True) as txn:
                    raw = txn.get(_key(index))
                    if raw is None:
                        raise MissingEntryError(f"entry {index} is not kept", index)
                    return entry_slice(raw, index, offset, length)
            except lmdb.MapResizedError:
                env.set_mapsize(0)  # the writer grew the map: take its size
            except lmdb.Error as e:  # the group's databases dropped meanwhile
                self.close()
                raise MissingEntryError(
                    f"entry {index}: the log is not readable: {e}", index
                ) from e
        raise MissingEntryError(f"entry {index}: the log's map keeps changing", index)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env, self._file = None, None
