"""A data group's Raft log in its process's log store: found, brought in
from the layout of one environment per group, checked, and set aside alone
when damaged (``damage``'s rules, for one group of a shared store).

Before the log store (issue 42), data group g kept its log in an LMDB
environment of its own, ``groups/<g>/raft``. Such a log is migrated at
start: checked whole as before (``damage.open_log``), copied into the store
(``LogStore.adopt``, records as stored, so its checksums still hold),
checked there, and only then are its files removed (the directory stays:
it holds the catching-up marker). A crash before the copy is marked leaves
the old log as it was; after it, the store's copy is the log and the old
files are removed at the next start.

Invariants: a group's log is in exactly one place when the group starts;
a damaged group's records are copied aside (durably) before they are
dropped, and the group starts empty and catches up (``DamagedLogError``
where no peer can), while every other group of the store keeps its log.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb

from node_daemon.raft import HardState
from node_daemon.raft.errors import MissingEntryError, StorageError
from node_daemon.storage import damage, kept_log
from node_daemon.storage.disk import fsync_dir
from node_daemon.storage.log_store import (
    STORES_DIR,
    LogStore,
    db_names,
    read_env,
    sibling_stores,
    store_holds,
    stores_in,
)
from node_daemon.storage.raft_log import LmdbLogStorage, LogReader, _key, entry_slice

log = logging.getLogger("roadlog.node.damage")

LEGACY_FILES = ("data.mdb", "lock.mdb")  # a per-group environment's files in ``raft/``


def group_data_dir(data_dir: Path, group: int) -> Path:
    """Where Raft group ``group`` keeps its state and snapshots (and group
    0 its log): group 0 (the metadata group) in the data directory itself,
    as a node with one group always did; data group g in ``groups/<g>``."""
    return data_dir if group == 0 else data_dir / "groups" / str(group)


def legacy_log(group_dir: Path) -> Path | None:
    """The group's log in the layout of one environment per group, if any."""
    raft = group_dir / "raft"
    return raft if (raft / "data.mdb").exists() else None


def _remove_legacy(raft: Path) -> None:
    for name in LEGACY_FILES:
        (raft / name).unlink(missing_ok=True)
    fsync_dir(raft)


def _migrate(
    store: LogStore, group: int, group_dir: Path, can_catch_up: bool
) -> tuple[str, HardState]:
    """Bring the group's per-group log into ``store`` (see the module
    docstring); why it was set aside on the way ('' if it was not) and the
    hard state the damaged one held."""
    old, why, kept = damage.open_log(group_dir, group, can_catch_up)
    try:
        t0 = time.monotonic()
        copy = store.adopt(group, old)
        bad = copy.verify()
        if bad or copy.last_index() != old.last_index():
            store.drop(group)
            raise StorageError(
                f"group {group}'s log copied into {store.path} reads back damaged (entry {bad}): "
                f"its log in {group_dir / 'raft'} is left as it was"
            )
        log.info(
            "moved a group's log into the process's log store",
            extra={"group": group, "store": str(store.path), "last_index": copy.last_index(),
                   "s": round(time.monotonic() - t0, 3)},
        )  # fmt: skip
    finally:
        old.close()
    _remove_legacy(group_dir / "raft")
    return why, kept


def _drop_elsewhere(store: LogStore, group: int) -> None:
    """Drop the copies of group ``group``'s log that other stores of the
    node still hold (a move cut short after its copy was made)."""
    for path in sibling_stores(store.path):
        other = LogStore(path, writer=False)
        try:
            if other.holds(group):
                other.drop(group)
                log.info(
                    "dropped a moved group's old log", extra={"group": group, "store": str(path)}
                )
        finally:
            other.close()


def _move_in(store: LogStore, group: int) -> None:
    """Move group ``group``'s log into ``store`` from another store of the
    node that holds it (the node restarted with another number of worker
    processes): copied, checked, then dropped there. Nothing where no
    other store holds it (a group new here)."""
    for path in sibling_stores(store.path):
        other = LogStore(path, writer=False)
        try:
            if not other.holds(group):
                continue
            source = other.open(group)
            damaged = source.verify()  # then moved as it is, and set aside here
            copy = store.adopt(group, source)
            bad = 0 if damaged else copy.verify()
            if bad or copy.last_index() != source.last_index():
                store.drop(group)
                raise StorageError(
                    f"group {group}'s log copied from {path} into {store.path} reads back "
                    f"damaged (entry {bad}): left in {path} as it was"
                )
            other.drop(group)
            log.info("moved a group's log to this process's log store",
                     extra={"group": group, "from": str(path), "to": str(store.path)})  # fmt: skip
            return
        finally:
            other.close()


def _damage_of(store: LogStore, group: int) -> str:
    """Why group ``group``'s log in ``store`` cannot be trusted ('' if it can)."""
    try:
        bad = store.open(group).verify()
    except damage.LMDB_DAMAGE as e:
        return f"LMDB cannot read the log: {e}"
    except (struct.error, ValueError) as e:  # its hard state or snapshot record
        return f"the log's records cannot be read: {e}"
    return f"entry {bad} of the log is corrupt or missing" if bad else ""


def open_group_log(
    store: LogStore, group: int, group_dir: Path, can_catch_up: bool = True
) -> tuple[LmdbLogStorage, str, HardState]:
    """Group ``group``'s log in ``store``, checked whole (every entry's
    checksum); migrated from ``group_dir/raft`` where it is still there; a
    damaged one set aside and an empty log made instead (as
    ``damage.open_log``). Returns the log, why it was set aside ('' if it
    was not), and the hard state the damaged log held."""
    legacy = legacy_log(group_dir)
    if not (group_dir / "raft").is_dir():  # where the group's catching-up marker lives
        (group_dir / "raft").mkdir(parents=True)
        fsync_dir(group_dir)
    why, kept = "", HardState()
    if store.holds(group):
        if legacy is not None:
            _remove_legacy(legacy)  # migrated before a crash: the store's copy is the log
        _drop_elsewhere(store, group)  # moved before a crash: likewise
    elif legacy is not None:
        why, kept = _migrate(store, group, group_dir, can_catch_up)
        if why:
            return store.open(group), why, kept
    else:
        _move_in(store, group)
    t0 = time.monotonic()
    why = _damage_of(store, group)
    log.debug("log checked", extra={"group": group, "s": round(time.monotonic() - t0, 3)})
    if not why:
        return store.open(group), "", HardState()
    try:
        kept = store.open(group).initial_state()
    except (*damage.LMDB_DAMAGE, struct.error, ValueError):
        kept = HardState()
    if not can_catch_up:
        raise damage.DamagedLogError(
            f"the log of group {group} in {store.path} is damaged ({why}) and no peer can "
            "catch this node up: restore it from a backup (roadlog-node restore)"
        )
    aside = damage.set_aside(group_dir, why)
    if aside is not None:
        _copy_aside(store.open(group), aside / "raft")
    store.drop(group)
    log.error(
        "the log is damaged: set aside; this group starts empty and catches up",
        extra={"group": group, "why": why, "aside": str(aside)},
    )
    return store.open(group), why, kept


def _copy_aside(damaged: LmdbLogStorage, dest: Path) -> None:
    """The damaged log's records as stored, in an environment of its own in
    ``dest`` (for a post-mortem only: no room for it is no failure)."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        damaged.copy_records(dest)
        fsync_dir(dest)
        fsync_dir(dest.parent)
    except Exception as e:  # a copy that fails is one less post-mortem, not a node down
        log.warning(
            "could not copy the damaged log aside", extra={"dest": str(dest), "error": str(e)}
        )


def check_store(path: Path, group_dirs: Iterable[Path], can_catch_up: bool = True) -> str:
    """Before ``LogStore(path)`` opens it: a store file shorter than its
    pages (``damage.truncated``) is read whole in a child process and, if
    every record reads, rewritten (as a group 0 log is: ``damage``); one
    that does not read is set aside whole (``logs/corrupt-<name>-<time>``)
    with every group of it (``group_dirs``: their states were made from
    it), and they start empty and catch up. Why it was set aside ('' if
    it was not)."""
    why = damage.truncated(path)
    if not why:
        return ""
    child = _read_in_child(path)
    if not child:
        return ""
    why = f"{why}; {child}"
    if not can_catch_up:
        raise damage.DamagedLogError(
            f"the log store {path} is damaged ({why}) and no peer can catch this node up: "
            "restore it from a backup (roadlog-node restore)"
        )
    for group_dir in group_dirs:
        if group_dir.exists():
            damage.set_aside(group_dir, why)
    aside = path.parent / f"corrupt-{path.name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    os.replace(path, aside)
    fsync_dir(path.parent)
    log.error("the log store is damaged: set aside whole; its groups start empty and catch up",
              extra={"store": str(path), "why": why, "aside": str(aside)})  # fmt: skip
    return why


def _read_in_child(path: Path) -> str:
    """Read every group's log of the store in ``path`` in a child process
    (a SIGBUS kills it, not this one) and, if all read whole, rewrite the
    file from a copy of every record (its free pages may be past the end
    of the file: ``damage.read_in_child``). Why it cannot be trusted ('' if
    it can)."""
    compact = path / "compact.tmp"
    shutil.rmtree(compact, ignore_errors=True)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from node_daemon.storage.log_store import LogStore\n"
        "s = LogStore(Path(sys.argv[1]))\n"
        "bad = [g for g in s.placed() if s.open(g).verify()]\n"
        "if not bad:\n"
        "    c = LogStore(Path(sys.argv[2]))\n"
        "    for g in s.placed():\n"
        "        c.adopt(g, s.open(g))\n"
        "    bad = [g for g in c.placed() if c.open(g).verify()]\n"
        "    c.close()\n"
        "print(' '.join(map(str, bad)) or 'ok')\n"
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, str(path), str(compact)],
            capture_output=True, text=True, timeout=600,
            cwd=str(Path(__file__).resolve().parents[2]),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "reading the log store whole took over 600 s"
    if r.returncode != 0:
        return f"reading the log store failed (exit {r.returncode}): {r.stderr.strip()[-200:]}"
    out = r.stdout.split()
    if out != ["ok"]:
        return f"the logs of groups {' '.join(out)} are corrupt or missing"
    os.replace(compact / "data.mdb", path / "data.mdb")
    fsync_dir(path)
    shutil.rmtree(compact, ignore_errors=True)
    log.warning("the log store's data file was shorter than its pages: rewritten",
                extra={"dir": str(path)})  # fmt: skip
    return ""


class GroupLogReader:
    """Read-only access to data group ``group``'s log from another process
    (the main process reading a worker's group; a backup): ``read_slice``
    as ``LmdbLogStorage``'s, wherever the log is: in a log store beside
    ``group_dir`` (``logs/*``) or, not migrated yet, in ``group_dir/raft``.
    A log that moves or is set aside is looked for again."""

    def __init__(self, group_dir: Path, group: int) -> None:
        self.group = group
        self._stores = group_dir.parent.parent / STORES_DIR
        self._legacy = LogReader(group_dir / "raft")
        self._at: tuple[lmdb.Environment, Any] | None = None

    def locate(self) -> tuple[lmdb.Environment, Any] | None:
        """The environment and the log database that hold the group's log
        now (None: no store does)."""
        if self._at is None:
            for path in stores_in(self._stores):
                try:
                    env = read_env(path)
                except lmdb.Error:  # being made, or set aside, right now
                    continue
                if store_holds(env, self.group):
                    self._at = env, env.open_db(db_names(self.group)[0], create=False)
                    break
        return self._at

    def read_slice(self, index: int, offset: int, length: int) -> bytes:
        for _ in range(3):
            at = self.locate()
            if at is None:
                return self._legacy.read_slice(index, offset, length)
            env, db = at
            try:
                with env.begin(db=db, buffers=True) as txn:
                    raw = txn.get(_key(index))
                    if raw is None:
                        raise MissingEntryError(f"entry {index} is not kept", index)
                    return entry_slice(raw, index, offset, length)
            except lmdb.MapResizedError:
                env.set_mapsize(0)  # the writer grew the map: take its size
            except lmdb.Error:  # the group's log moved, or was set aside
                self._at = None
        raise MissingEntryError(f"entry {index}: group {self.group}'s log keeps moving", index)

    def close(self) -> None:
        self._legacy.close()
        self._at = None  # the environments are the process's (``read_env``)


def bundle_group_log(
    group_dir: Path, group: int, state_file: Path, dest: Path, lo: int, hi: int
) -> None:
    """``kept_log.bundle`` from data group ``group``'s log, wherever it is."""
    at = GroupLogReader(group_dir, group).locate()
    if at is None:
        kept_log.bundle_from_log_dir(state_file, dest, group_dir / "raft", lo, hi)
    else:
        kept_log.bundle(state_file, dest, at[0], at[1], lo, hi)
