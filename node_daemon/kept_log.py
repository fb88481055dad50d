"""Log entries that travel with a state snapshot (docs/one-copy.md).

The state stores replicated ping batches as references into the Raft log
entries that carried them (``state.batch_refs``), so a copy of the state is
only whole together with the entries it refers to. A snapshot sent to a
follower, or a backup, is the state's copy with those entries added in a
named database, ``keptlog``: each entry under its log key, its stored value
as the log holds it (header, checksum, data), so that the receiver's log
takes it byte for byte and its checksum still holds.

- ``bundle`` makes such a file from a state snapshot and a log;
- ``import_kept`` takes the entries into a log's write transaction (a
  follower installing the snapshot: its log is replaced by the snapshot's);
- ``copy_state_without_kept`` installs the state part alone;
- ``KeptLogReader`` reads a group's log from another process (a worker's
  group, read by the node's main process), read-only.

Invariant: a file with ``keptlog`` holds every entry from its lowest to its
highest key (no gap), and the state it carries refers to none outside them.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from node_daemon.disk import fsync_dir
from node_daemon.raft.errors import MissingEntryError

KEPT_DB = b"keptlog"
STATE_DBS = 16  # the state environment's max_dbs (and one for keptlog)
TXN_BYTES = 64 << 20  # a bundle's entries are written this much per transaction
_KEY = struct.Struct(">Q")
_HDR_SIZE = 9  # term (8 bytes) and type (1 byte), as raft_log stores an entry
_CHECKED = 0x80
_BODY = _HDR_SIZE + 8  # where a checked entry's data starts


def slice_of(raw: Any, index: int, offset: int, length: int) -> bytes:
    """``length`` bytes of a stored entry value's data from ``offset``."""
    checked = len(raw) > _HDR_SIZE and raw[_HDR_SIZE - 1] & _CHECKED
    body = _BODY if checked else _HDR_SIZE
    if len(raw) < body + offset + length:
        raise MissingEntryError(f"entry {index} is shorter than a batch it holds", index)
    return bytes(raw[body + offset : body + offset + length])


def _entries(cur: Any, lo: int, hi: int) -> Iterator[tuple[bytes, bytes]]:
    """The stored entries ``lo``..``hi`` from a cursor of a log; raises
    ``MissingEntryError`` on the first one missing (a gap, or an end short
    of ``hi``)."""
    expect = lo
    if hi >= lo and cur.set_range(_KEY.pack(lo)):
        for k, v in cur:
            index = _KEY.unpack(k)[0]
            if index > hi:
                break
            if index != expect:
                break
            yield k, v
            expect += 1
    if expect <= hi:
        raise MissingEntryError(f"the log no longer keeps entry {expect} (of {lo}..{hi})", expect)


def _add_rows(file: Path, rows: Iterable[tuple[bytes, bytes]], room: int) -> None:
    """Put ``rows`` (in key order) into the ``keptlog`` of the LMDB file
    ``file``, in write transactions of at most ``TXN_BYTES`` (what is held
    in memory stays bounded however many there are); fsynced. ``room``: at
    least the bytes the rows take."""
    env = lmdb.open(
        str(file),
        subdir=False,
        max_dbs=STATE_DBS + 1,
        map_size=os.path.getsize(file) + 2 * room + (64 << 20),
        lock=False,
        sync=False,
    )
    try:
        it = iter(rows)
        more = True
        while more:
            more = False
            with env.begin(write=True) as wtxn:
                cur = wtxn.cursor(db=env.open_db(KEPT_DB, txn=wtxn))
                size = 0
                for k, v in it:
                    cur.put(k, v, append=True)
                    size += len(k) + len(v)
                    if size >= TXN_BYTES:
                        more = True
                        break
        env.sync(True)
    finally:
        env.close()


def _made_as(dest: Path, make: Callable[[Path], None]) -> None:
    """Make ``dest`` by ``make(tmp)`` under a temporary name, fsynced and
    renamed into place (nothing left behind on an error)."""
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        make(tmp)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def bundle(
    state_file: Path,
    dest: Path,
    log_env: lmdb.Environment,
    log_db: Any,
    lo: int,
    hi: int,
) -> None:
    """Write ``dest``: the state snapshot ``state_file`` with the log's
    entries ``lo``..``hi`` (as stored, read in one read transaction) added
    under ``keptlog``. ``MissingEntryError`` (and no ``dest``) if the log
    does not hold all of them."""

    def make(tmp: Path) -> None:
        shutil.copyfile(state_file, tmp)
        with log_env.begin(db=log_db) as rtxn:
            _add_rows(tmp, _entries(rtxn.cursor(), lo, hi), log_env.info()["map_size"])

    _made_as(dest, make)


def bundle_from_log_dir(state_file: Path, dest: Path, log_dir: Path, lo: int, hi: int) -> None:
    """``bundle`` with the entries read from the Raft log in ``log_dir``,
    opened read-only (another process, a backup, while the node runs)."""
    env = lmdb.open(str(log_dir), readonly=True, max_dbs=4, readahead=False)
    try:
        bundle(state_file, dest, env, env.open_db(b"log", create=False), lo, hi)
    finally:
        env.close()


@contextmanager
def _carried(snapshot_file: Path) -> Iterator[Any]:
    """A cursor on the first entry ``snapshot_file`` carries (in a read
    transaction open while the block runs), None if it carries none or is
    not an LMDB file."""
    try:
        env = lmdb.open(
            str(snapshot_file), subdir=False, readonly=True, lock=False, max_dbs=STATE_DBS + 1
        )
    except lmdb.Error:
        yield None
        return
    try:
        try:
            db = env.open_db(KEPT_DB, create=False)
        except lmdb.NotFoundError:
            yield None
            return
        with env.begin(db=db) as txn:
            cur = txn.cursor()
            yield cur if cur.first() else None
    finally:
        env.close()


def carry_over(src: Path, dest: Path) -> bool:
    """Add the entries the snapshot file ``src`` carries to the snapshot
    file ``dest`` (a state made from it); False if it carries none."""
    with _carried(src) as cur:
        if cur is None:
            return False
        _add_rows(dest, cur.iternext(), os.path.getsize(src))
        return True


def kept_range(snapshot_file: Path) -> tuple[int, int] | None:
    """The (lowest, highest) index of the entries ``snapshot_file`` carries,
    None if it carries none."""
    with _carried(snapshot_file) as cur:
        if cur is None:
            return None
        lo = _KEY.unpack(cur.key())[0]
        cur.last()
        return lo, _KEY.unpack(cur.key())[0]


def import_kept(txn: Any, log_db: Any, snapshot_file: Path) -> int | None:
    """Put the entries ``snapshot_file`` carries into ``log_db`` in the write
    transaction ``txn`` (whose log holds nothing at their indexes); the
    lowest of them, None if it carries none."""
    if not snapshot_file.is_file():
        return None
    with _carried(snapshot_file) as cur:
        if cur is None:
            return None
        lowest = int(_KEY.unpack(cur.key())[0])
        txn.cursor(db=log_db).putmulti(cur.iternext(), append=True)
        return lowest


def copy_state_without_kept(snapshot_file: Path, dest_dir: Path) -> bool:
    """Write the state ``snapshot_file`` carries, without its ``keptlog``, as
    a new environment in ``dest_dir`` (every other database copied record
    by record, so the file is the state's size, not the entries'); fsynced.
    False, writing nothing, if it carries no ``keptlog`` (copy the file as
    it is)."""
    src = lmdb.open(
        str(snapshot_file), subdir=False, readonly=True, lock=False, max_dbs=STATE_DBS + 1
    )
    try:
        with src.begin() as rtxn:
            names = [bytes(k) for k, _ in rtxn.cursor()]
        if KEPT_DB not in names:
            return False
        dest_dir.mkdir(parents=True, exist_ok=True)
        dst = lmdb.open(
            str(dest_dir),
            max_dbs=STATE_DBS,
            map_size=max(src.info()["map_size"], os.path.getsize(snapshot_file)),
            sync=False,
        )
        try:
            with src.begin() as rtxn, dst.begin(write=True) as wtxn:
                for name in names:
                    if name == KEPT_DB:
                        continue
                    sdb = src.open_db(name, txn=rtxn, create=False)
                    ddb = dst.open_db(name, txn=wtxn)
                    wtxn.cursor(db=ddb).putmulti(rtxn.cursor(db=sdb).iternext(), append=True)
            dst.sync(True)
        finally:
            dst.close()
        (dest_dir / "lock.mdb").unlink(missing_ok=True)
        return True
    finally:
        src.close()


class KeptLogReader:
    """Read-only access to a group's Raft log from another process (the
    node's main process reading a worker's group): ``read_slice`` as the
    log's own. LMDB's readers span processes; a map the writer grew is
    adopted on the next read, and a log set aside and made anew under the
    same path (a damaged one, ``damage.py``) is opened again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._env: lmdb.Environment | None = None
        self._db: Any = None
        self._file: tuple[int, int] | None = None  # (device, inode) of the open data file

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path / "data.mdb")
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def _open(self) -> lmdb.Environment:
        ident = self._identity()
        if self._env is not None and ident != self._file:
            self.close()  # another log under this path now
        if self._env is None:
            try:
                env = lmdb.open(str(self.path), readonly=True, max_dbs=4, readahead=False)
            except lmdb.Error as e:
                raise MissingEntryError(f"the log in {self.path} is not readable: {e}", 0) from e
            try:
                self._db = env.open_db(b"log", create=False)
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
                    raw = txn.get(_KEY.pack(index))
                    if raw is None:
                        raise MissingEntryError(f"entry {index} is not kept", index)
                    return slice_of(raw, index, offset, length)
            except lmdb.MapResizedError:
                env.set_mapsize(0)  # the writer grew the map: take its size
        raise MissingEntryError(f"entry {index}: the log's map keeps changing", index)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env, self._file = None, None
