"""Consistent backups of a node's state, and restoring a cluster from one.

A backup is a directory with `state.mdb` (a compact LMDB copy of the state
machine, taken inside one read transaction, so it is exactly the state at
its applied index) and `manifest.json` (cluster, node, applied index and
term, size, SHA-256). It can be taken from a running node: LMDB lets
another process read while the node writes, and the copy never blocks it.

Restoring works like etcd's snapshot restore: every node of the cluster is
stopped and restored from the same backup with the same voter list, so all
of them start from an identical state machine and a Raft log that begins
with a snapshot at the backup's index (configuration = the given voters).
Writes acknowledged after the backup was taken are gone; that is what a
restore means. The node's previous data is moved aside, never deleted, and
its identity (`node_id`) is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lmdb

from node_daemon.raft.types import ConfState, HardState, Snapshot, SnapshotMeta
from node_daemon.raft_log import LmdbLogStorage
from node_daemon.state.machine import _U64, StateMachine

STATE_FILE = "state.mdb"
MANIFEST = "manifest.json"


class BackupError(Exception):
    """A backup cannot be taken, checked or restored; the message says why."""


@dataclass(frozen=True)
class Manifest:
    cluster_name: str
    node_id: int
    applied_index: int
    applied_term: int
    bytes: int
    sha256: str
    created_ms: int
    format: int = 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def take_backup(data_dir: Path, out: Path, cluster_name: str, node_id: int) -> Manifest:
    """Copy the state machine under `data_dir` into the new directory `out`.

    Safe while the node runs. The copy and the applied index it reports come
    from the same read transaction."""
    state = data_dir / "state"
    if not (state / "data.mdb").exists():
        raise BackupError(f"{state}: no state machine here (is data_dir right?)")
    if out.exists() and any(out.iterdir()):
        raise BackupError(f"{out}: exists and is not empty")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = lmdb.open(str(state), readonly=True, max_dbs=16, lock=True, readahead=False)
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin() as txn:
            raw_index, raw_term = (
                txn.get(b"applied_index", db=meta),
                txn.get(b"applied_term", db=meta),
            )
            index = _U64.unpack(raw_index)[0] if raw_index else 0
            term = _U64.unpack(raw_term)[0] if raw_term else 0
            env.copy(str(tmp), compact=True, txn=txn)
    finally:
        env.close()
    data = tmp / "data.mdb"
    with open(data, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(data, tmp / STATE_FILE)
    manifest = Manifest(
        cluster_name=cluster_name,
        node_id=node_id,
        applied_index=index,
        applied_term=term,
        bytes=(tmp / STATE_FILE).stat().st_size,
        sha256=_sha256(tmp / STATE_FILE),
        created_ms=int(time.time() * 1000),
    )
    (tmp / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    _fsync_dir(tmp)
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    _fsync_dir(out.parent)
    return manifest


def verify_backup(backup: Path, cluster_name: str) -> Manifest:
    """The manifest, after checking the file against it and the cluster."""
    try:
        raw = json.loads((backup / MANIFEST).read_text())
        manifest = Manifest(**raw)
    except (OSError, ValueError, TypeError) as e:
        raise BackupError(f"{backup / MANIFEST}: not a roadlog backup manifest ({e})") from None
    state = backup / STATE_FILE
    if not state.exists() or state.stat().st_size != manifest.bytes:
        raise BackupError(f"{state}: missing or not {manifest.bytes} bytes")
    if _sha256(state) != manifest.sha256:
        raise BackupError(f"{state}: SHA-256 does not match the manifest (corrupt copy)")
    if manifest.cluster_name != cluster_name:
        raise BackupError(
            f"the backup is of cluster {manifest.cluster_name!r}, this node is in {cluster_name!r}"
        )
    if manifest.applied_index == 0:
        raise BackupError("the backup holds an empty state (applied index 0)")
    return manifest


def restore_backup(data_dir: Path, backup: Path, cluster_name: str, voters: dict[int, str]) -> Path:
    """Make `data_dir` start from `backup` with `voters` as the configuration.

    The node must be stopped. Returns where the previous data was moved.
    Every node restored from the same backup with the same voters gets the
    same state machine (the address book is rewritten to `voters`)."""
    manifest = verify_backup(backup, cluster_name)
    if not voters:
        raise BackupError("restore needs the voters (ID=HOST:PORT,...)")
    aside = data_dir / f"pre-restore-{int(time.time())}"
    aside.mkdir(parents=True)
    for name in ("raft", "state", "snapshots", "state.incoming", "state.old"):
        if (data_dir / name).exists():
            os.replace(data_dir / name, aside / name)
    snapshots = data_dir / "snapshots"
    snapshots.mkdir()
    snap_file = snapshots / f"snap-{manifest.applied_index}-{manifest.applied_term}.mdb"
    shutil.copyfile(backup / STATE_FILE, snap_file)
    sm = StateMachine(data_dir / "state")
    try:
        sm.install_snapshot(snap_file)
        sm.replace_address_book(voters)
        if sm.applied_index != manifest.applied_index:
            raise BackupError(
                f"restored state is at {sm.applied_index}, the manifest says "
                f"{manifest.applied_index}"
            )
    finally:
        sm.close()
    # The installed state doubles as the Raft snapshot a lagging peer is sent.
    snap_meta = SnapshotMeta(
        manifest.applied_index, manifest.applied_term, ConfState(frozenset(voters))
    )
    shutil.copyfile(data_dir / "state" / "data.mdb", snap_file)
    store = LmdbLogStorage(data_dir / "raft")
    try:
        store.save(
            HardState(term=manifest.applied_term, vote=0, commit=manifest.applied_index),
            [],
            Snapshot(snap_meta, str(snap_file).encode()),
        )
    finally:
        store.close()
    _fsync_dir(data_dir)
    return aside
