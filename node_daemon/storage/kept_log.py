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
- ``copy_state_without_kept`` installs the state part alone.

The entries are copied as stored, never read: their layout is raft_log's.

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

from node_daemon.raft.errors import MissingEntryError
from node_daemon.storage.disk import fsync_dir

KEPT_DB = b"keptlog"
STATE_DBS = 16  # the state environment's max_dbs (and one for keptlog)
TXN_BYTES = 64 << 20  # a bundle's entries are written this much per transaction
_KEY = struct.Struct(">Q")  # a log entry's key (raft_log's): its index


def open_snapshot_file(snapshot_file: str | os.PathLike[str]) -> lmdb.Environment:
    """A state snapshot file (an LMDB data file, maybe with ``keptlog``),
    opened read-only and without a lock file."""
    return lmdb.open(
        str(snapshot_file), subdir=False, readonly=True, lock=False, max_dbs=STATE_DBS + 1
    )


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
        env = open_snapshot_file(snapshot_file)
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
    src = open_snapshot_file(snapshot_file)
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
