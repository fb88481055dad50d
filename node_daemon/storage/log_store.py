"""One LMDB environment for the Raft logs of many groups: a process's log store.

The data groups a process runs (a worker's share, or every data group
where the main process runs them) keep their Raft logs in one environment,
``logs/<name>/`` under the data directory, so that one write transaction
and one fsync persist what every group's Ready asks for (``commit``; the
event loop's side is ``group_commit``). Group 0 keeps its log in an
environment of its own (``LmdbLogStorage(path)``), as ever.

Layout: group g's log in the named databases ``<g>/log``, ``<g>/conf`` and
``<g>/meta``, each as ``raft_log`` lays out a log of its own (the entries'
checksums included); ``groups``: 4-byte big-endian group -> ``b""`` for
each group whose log is whole here.

Invariants:
- A group's log counts as here only once ``groups`` names it. A log moved
  in (``adopt``: one written in the layout of one environment per group,
  ``groups/<g>/raft``) is copied and marked in one transaction; whatever a
  crash left of a group that is not marked is dropped before the group is
  made anew or adopted again. The source is removed only after the copy is
  durable and checked (``log_homes``).
- ``commit`` is one write transaction, fsynced before it returns: every
  group's save in it is on disk, or none is; each group's in-memory view
  moves only after the commit.
- One group's log is checked (``LmdbLogStorage.verify``), set aside and
  dropped (``drop``) without touching another group's records.
- One writer thread (``io``) for every write of the store: the batches and
  each group's compactions run there in order; reads go on any thread.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb

from node_daemon.raft.types import Entry, HardState, Snapshot
from node_daemon.storage.disk import data_file_identity, fsync_dir, open_lmdb
from node_daemon.storage.io_thread import IoThread
from node_daemon.storage.raft_log import GiB, LmdbLogStorage, write_txn
from roadlog import round_trace
from roadlog.placement import MAX_DATA_GROUPS

STORES_DIR = "logs"  # under the data directory: one store per process running data groups
MAX_DBS = 3 * (MAX_DATA_GROUPS + 1) + 1  # three per group, and ``groups``
_PLACED_DB = b"groups"
_GROUP = struct.Struct(">I")

# One group's save in a batch: its log, hard state, entries and snapshot.
Save = tuple[LmdbLogStorage, HardState | None, Sequence[Entry], Snapshot | None]


def db_names(group: int) -> tuple[bytes, bytes, bytes]:
    """Group ``group``'s named databases: its log, configurations, metadata."""
    return b"%d/log" % group, b"%d/conf" % group, b"%d/meta" % group


def store_dir(data_dir: Path, name: str) -> Path:
    """Where the log store ``name`` (``main``, ``worker-<i>``) lives."""
    return data_dir / STORES_DIR / name


_READ_ENVS: dict[Path, tuple[tuple[int, int] | None, lmdb.Environment]] = {}
_WRITERS: dict[Path, lmdb.Environment] = {}  # the stores this process has open to write
_READ_LOCK = threading.Lock()


def read_env(path: Path) -> lmdb.Environment:
    """The log store in ``path`` opened read-only, once per process and
    data file: LMDB must not have one environment open twice in a process
    (closing one would drop the other's locks). A data file replaced under
    the path (rewritten after damage) is opened anew; the old one stays
    open for the reads that may still hold it."""
    ident = data_file_identity(path)
    with _READ_LOCK:
        if path.resolve() in _WRITERS:  # this process writes it: read through that
            return _WRITERS[path.resolve()]
        held = _READ_ENVS.get(path)
        if held is None or held[0] != ident:
            env = lmdb.open(str(path), readonly=True, max_dbs=MAX_DBS, readahead=False)
            held = _READ_ENVS[path] = (ident, env)
        return held[1]


def store_holds(env: lmdb.Environment, group: int) -> bool:
    """Whether the store ``env`` holds group ``group``'s log whole."""
    try:
        with env.begin() as txn:
            placed = env.open_db(_PLACED_DB, txn=txn, create=False)
            return txn.get(_GROUP.pack(group), db=placed) is not None
    except lmdb.NotFoundError:
        return False


def stores_in(root: Path) -> list[Path]:
    """The log stores in ``root`` (``logs/`` of a data directory), not
    those set aside."""
    if not root.is_dir():
        return []
    return sorted(
        d for d in root.iterdir()
        if d.is_dir() and not d.name.startswith("corrupt-") and (d / "data.mdb").exists()
    )  # fmt: skip


def sibling_stores(path: Path) -> list[Path]:
    """The other log stores beside the one in ``path``."""
    return [d for d in stores_in(path.parent) if d != path]


class LogStore:
    """The Raft logs of a process's groups in one LMDB environment in ``path``."""

    def __init__(
        self,
        path: Path,
        map_size: int = 1 * GiB,
        max_map_size: int = 256 * GiB,
        writer: bool = True,
    ) -> None:
        """``writer`` False: no writer thread (a store opened only to move a
        group out of it, or to check it)."""
        self.path = Path(path)
        made = not self.path.parent.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        if made:  # ``logs/`` itself is new: its name survives a power loss too
            fsync_dir(self.path.parent.parent)
        self.max_map_size = max(map_size, max_map_size)
        self.env = open_lmdb(  # a full disk: StorageFullError, not a SIGBUS
            self.path,
            "log store",
            map_size=map_size,
            max_dbs=MAX_DBS,
            sync=True,
            metasync=True,
            readahead=False,
        )
        self._placed = self.env.open_db(_PLACED_DB)
        with _READ_LOCK:
            _WRITERS[self.path.resolve()] = self.env
        self.logs: dict[int, LmdbLogStorage] = {}  # the groups opened, by number
        self._io = IoThread("raft-log") if writer else None
        self.commits = 0  # synced transactions of ``commit``
        self.saves = 0  # groups' saves they carried

    @property
    def io(self) -> IoThread:
        """The store's writer thread: every write of the store, in order."""
        if self._io is None:
            raise RuntimeError(f"the log store in {self.path} was opened without a writer")
        return self._io

    # -- groups ----------------------------------------------------------------

    def placed(self) -> list[int]:
        """The groups whose log is whole here, in order."""
        with self.env.begin(db=self._placed) as txn:
            return [_GROUP.unpack(k)[0] for k in txn.cursor().iternext(values=False)]

    def holds(self, group: int) -> bool:
        with self.env.begin(db=self._placed) as txn:
            return txn.get(_GROUP.pack(group)) is not None

    def open(self, group: int, cache_bytes: int = 32 << 20) -> LmdbLogStorage:
        """Group ``group``'s log (empty for a group new here: made, after
        dropping whatever an unfinished adoption left of it)."""
        if not self.holds(group):
            self._make(group, None)
        return self._view(group, cache_bytes)

    def adopt(
        self, group: int, source: LmdbLogStorage, cache_bytes: int = 32 << 20
    ) -> LmdbLogStorage:
        """Copy ``source``'s every record (as stored: checksums and all)
        into group ``group``'s log here, which must not be held yet, and
        mark it held, in one synced transaction; its log."""
        if self.holds(group):
            raise ValueError(f"group {group} already has a log in {self.path}")
        self._make(group, source)
        return self._view(group, cache_bytes)

    def drop(self, group: int) -> None:
        """Remove group ``group``'s log (its records and its mark) in one
        synced transaction; no other group's record is touched."""
        self.logs.pop(group, None)

        def body(txn: Any) -> Any:
            self._drop_dbs(txn, group)
            txn.delete(_GROUP.pack(group), db=self._placed)
            return lambda: None

        write_txn(self.env, self.path, self.max_map_size, body)

    def _make(self, group: int, source: LmdbLogStorage | None) -> None:
        def body(txn: Any) -> Any:
            self._drop_dbs(txn, group)  # what an unfinished adoption left
            names = db_names(group)
            for name in names:
                self.env.open_db(name, txn=txn)
            if source is not None:
                with source.env.begin() as rt:
                    source.copy_into(rt, txn, self.env, names)
            txn.put(_GROUP.pack(group), b"", db=self._placed)
            return lambda: None

        write_txn(self.env, self.path, self.max_map_size, body)

    def _drop_dbs(self, txn: Any, group: int) -> None:
        for name in db_names(group):
            if txn.get(name) is not None:  # the main database names it
                txn.drop(self.env.open_db(name, txn=txn), delete=True)

    def _view(self, group: int, cache_bytes: int) -> LmdbLogStorage:
        log = LmdbLogStorage(
            self.path,
            max_map_size=self.max_map_size,
            cache_bytes=cache_bytes,
            env=self.env,
            names=db_names(group),
        )
        self.logs[group] = log
        return log

    # -- writes ------------------------------------------------------------------

    def commit(self, saves: Sequence[Save]) -> None:
        """Persist every save in ``saves`` (groups' logs of this store, at
        most one save each) in one write transaction, fsynced: group commit
        across groups. Atomic: a failure (``StorageFullError`` for want of
        room) stores none of them and moves no view."""
        round_trace.mark("log0")

        def body(txn: Any) -> Any:
            views = [log.save_in(txn, hard, ents, snap) for log, hard, ents, snap in saves]

            def commit_views() -> None:
                for view in views:
                    view()

            return commit_views

        write_txn(self.env, self.path, self.max_map_size, body)
        round_trace.mark("log1")
        self.commits += 1
        self.saves += len(saves)

    def close(self) -> None:
        """Finish the writes handed over, then close the environment."""
        if self._io is not None:
            self._io.shutdown(wait=True)
        self.logs.clear()
        with _READ_LOCK:
            _WRITERS.pop(self.path.resolve(), None)
        self.env.close()
