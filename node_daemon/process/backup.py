"""Consistent backups of a node's state, and restoring a cluster from one.

A backup is a directory with `state.mdb` (a compact LMDB copy of the state
machine, taken inside one read transaction, so it is exactly the state at
its applied index) and `manifest.json` (cluster, node, applied index and
term, size, SHA-256 of `state.mdb`, and an HMAC-SHA256 of all of that under
the operators' backup key). A node that runs data groups (multi-raft) adds
`groups/<g>/state.mdb` for each, with its applied index and term, size and
SHA-256 under `groups` in the manifest. A state refers to its ping batches
in the Raft log beside it (docs/one-copy.md): each `state.mdb` also holds
those log entries (``kept_log``), which a restore gives to the new log. Each
group's copy is exact at its own index; group 0's is taken first, so no
consumer offset it holds points past the pings the data groups' copies hold
(a topic created between the copies may have pings in a data group that
group 0 does not know of: unreachable, as the write it came from is gone).
It can be taken from a running node: LMDB lets another process read while
the node writes, and the copy never blocks it.

The backup key (issue 19, finding 14) is not the cluster secret: only
operators hold it (a text file of at least 16 bytes, readable by its owner
only, e.g. `openssl rand -hex 32 > backup.key; chmod 600 backup.key`), and
the playbooks and `fab backup` hand it to `roadlog-node` on its stdin, so it
never lands on a host. Without the key nobody can make a backup that a
restore accepts: a changed `state.mdb` fails the SHA-256, a changed manifest
(or a SHA-256 made to match) fails the HMAC. Every file of a backup is 0600
in a 0700 directory, whatever the umask.

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
import hmac
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from node_daemon.raft.errors import MissingEntryError
from node_daemon.raft.types import ConfState, HardState, Snapshot, SnapshotMeta
from node_daemon.state.machine import _U64, StateMachine
from node_daemon.state.pings import oldest_ref_in_snapshot
from node_daemon.storage import kept_log
from node_daemon.storage.disk import fsync_dir
from node_daemon.storage.group_logs import bundle_group_log
from node_daemon.storage.log_store import STORES_DIR
from node_daemon.storage.raft_log import LmdbLogStorage
from roadlog.runtime.config import ConfigError, check_secret, check_secret_value

STATE_FILE = "state.mdb"
KEPT_ATTEMPTS = 3  # copies of a state whose log let referred-to entries go meanwhile
MANIFEST = "manifest.json"
FORMAT = 2  # 1: no HMAC (refused: anyone could have rewritten it)
MAC_FIELD = "hmac_sha256"
_MAC_CONTEXT = b"roadlog backup manifest v2\n"
MIN_KEY_BYTES = 16  # (the cluster secret's minimum is 32: MIN_SECRET_BYTES)


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
    format: int = FORMAT
    # Data group -> {"applied_index", "applied_term", "bytes", "sha256"}
    # (keys are strings: JSON); empty for a node without data groups.
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)


def backup_files(manifest: dict[str, Any]) -> list[str]:
    """The files of a backup, relative to its directory, from its manifest
    (as ``roadlog-node backup --json`` prints it): the manifest, group 0's
    state, and each data group's (``groups/<g>/state.mdb``)."""
    groups = sorted(manifest.get("groups", {}), key=int)
    return [MANIFEST, STATE_FILE, *(f"groups/{g}/{STATE_FILE}" for g in groups)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_backup_key(key: bytes) -> bytes:
    """``key`` if it may serve as the backup key (the cluster secret's
    rules: long enough, not a placeholder), else BackupError."""
    try:
        return check_secret_value(key, "backup key", MIN_KEY_BYTES)
    except ConfigError as e:
        raise BackupError(str(e)) from None


def read_backup_key(path: Path | None) -> bytes:
    """The operators' backup key from its file: refused when no file is
    given, when it is missing, open to the group or others (chmod 600),
    shorter than 16 bytes, or a placeholder (``check_secret``'s rules)."""
    if path is None:
        raise BackupError("backup key: required (--backup-key-file, a file only operators hold)")
    try:
        return check_secret(path, "backup key", private=0o077, minimum=MIN_KEY_BYTES)
    except ConfigError as e:
        raise BackupError(str(e)) from None


def _manifest_mac(fields: dict[str, object], key: bytes) -> str:
    """HMAC-SHA256 of the manifest's fields (canonical JSON), hex."""
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, _MAC_CONTEXT + body, hashlib.sha256).hexdigest()


def _write_private(path: Path, data: bytes) -> None:
    """A new file that only its owner may read (0600 whatever the umask), synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def take_backup(data_dir: Path, out: Path, cluster_name: str, node_id: int, key: bytes) -> Manifest:
    """Copy the state machine under `data_dir` into the new directory `out`,
    with a manifest authenticated under the backup `key`.

    Safe while the node runs. The copy and the applied index it reports come
    from the same read transaction. `out` and its files are its owner's only
    (0700, 0600)."""
    check_backup_key(key)
    state = data_dir / "state"
    if not (state / "data.mdb").exists():
        raise BackupError(f"{state}: no state machine here (is data_dir right?)")
    if out.exists() and any(out.iterdir()):
        raise BackupError(f"{out}: exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    # A private directory with a name nobody can guess (0700), next to `out`.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        manifest = _copy_into(data_dir, tmp, cluster_name, node_id, key)
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return manifest


def _data_groups(data_dir: Path) -> list[int]:
    """The data groups whose state lies under ``data_dir`` (node.group_data_dir)."""
    root = data_dir / "groups"
    if not root.is_dir():
        return []
    return sorted(
        int(d.name) for d in root.iterdir()
        if d.name.isdigit() and (d / "state" / "data.mdb").exists()
    )  # fmt: skip


def _copy_state(state: Path, dest: Path, group: int = 0) -> dict[str, Any]:
    """A compact copy of the state environment ``state`` as ``dest/state.mdb``
    (one read transaction), with the Raft log entries its batches refer to
    (``kept_log``: the state stores each batch as a reference into the log
    beside it, ``state.parent / "raft"``): its applied index and term, size
    and SHA-256. The log may let entries go between the two reads (a
    compaction after retention): then both are read again."""
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = dest / "data.mdb"
    for attempt in range(KEPT_ATTEMPTS):
        index, term = _copy_env(state, dest)
        lo = oldest_ref_in_snapshot(data)
        if lo is None:
            break
        try:
            if group == 0:
                kept_log.bundle_from_log_dir(data, data, state.parent / "raft", lo, index)
            else:  # a data group's log is in a log store (or, before, beside it)
                bundle_group_log(state.parent, group, data, data, lo, index)
            break
        except MissingEntryError:
            if attempt == KEPT_ATTEMPTS - 1:
                raise BackupError(
                    f"{state}: the Raft log let entries the state refers to go "
                    f"{KEPT_ATTEMPTS} times during the copy; try again"
                ) from None
    with open(data, "rb+") as f:
        os.fchmod(f.fileno(), 0o600)  # LMDB creates it 0666 less the umask
        os.fsync(f.fileno())
    os.replace(data, dest / STATE_FILE)
    fsync_dir(dest)
    return {
        "applied_index": index,
        "applied_term": term,
        "bytes": (dest / STATE_FILE).stat().st_size,
        "sha256": _sha256(dest / STATE_FILE),
    }


def _copy_env(state: Path, dest: Path) -> tuple[int, int]:
    """``dest/data.mdb``: a compact copy of ``state`` in one read
    transaction; its applied index and term."""
    (dest / "data.mdb").unlink(missing_ok=True)
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
            env.copy(str(dest), compact=True, txn=txn)
    finally:
        env.close()
    return index, term


def _copy_into(data_dir: Path, tmp: Path, cluster_name: str, node_id: int, key: bytes) -> Manifest:
    zero = _copy_state(data_dir / "state", tmp)  # group 0 first (see the module's docstring)
    groups = {str(g): _copy_state(data_dir / "groups" / str(g) / "state",
                                  tmp / "groups" / str(g), g)
              for g in _data_groups(data_dir)}  # fmt: skip
    if groups:
        fsync_dir(tmp / "groups")
    manifest = Manifest(
        cluster_name=cluster_name,
        node_id=node_id,
        created_ms=int(time.time() * 1000),
        groups=groups,
        **zero,
    )
    fields = asdict(manifest)
    if not groups:  # the layout of a backup without data groups, as before them
        del fields["groups"]
    doc = {**fields, MAC_FIELD: _manifest_mac(fields, key)}
    _write_private(tmp / MANIFEST, (json.dumps(doc, indent=2) + "\n").encode())
    return manifest


def verify_backup(backup: Path, cluster_name: str, key: bytes) -> Manifest:
    """The manifest, after checking its HMAC under the backup `key`, the
    file against it, and the cluster."""
    path = backup / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BackupError(f"{path}: not a roadlog backup manifest ({e})") from None
    if not isinstance(raw, dict):
        raise BackupError(f"{path}: not a roadlog backup manifest (not an object)")
    mac = raw.pop(MAC_FIELD, None)
    if not isinstance(mac, str):
        raise BackupError(
            f"{path}: not authenticated (no {MAC_FIELD}; format {raw.get('format', 1)} "
            "backups were not signed and cannot be trusted)"
        )
    if not hmac.compare_digest(mac.encode(), _manifest_mac(raw, key).encode()):
        raise BackupError(
            f"{path}: the HMAC does not match (the backup was changed, or made with another "
            "backup key)"
        )
    try:
        manifest = Manifest(**raw)
    except TypeError as e:
        raise BackupError(f"{path}: not a roadlog backup manifest ({e})") from None
    if manifest.format != FORMAT:
        raise BackupError(f"{path}: format {manifest.format}, this roadlog reads {FORMAT}")
    state = backup / STATE_FILE
    if not state.exists() or state.stat().st_size != manifest.bytes:
        raise BackupError(f"{state}: missing or not {manifest.bytes} bytes")
    if not hmac.compare_digest(_sha256(state), manifest.sha256):
        raise BackupError(f"{state}: SHA-256 does not match the manifest (corrupt copy)")
    if manifest.cluster_name != cluster_name:
        raise BackupError(
            f"the backup is of cluster {manifest.cluster_name!r}, this node is in {cluster_name!r}"
        )
    if manifest.applied_index == 0:
        raise BackupError("the backup holds an empty state (applied index 0)")
    for g, entry in manifest.groups.items():
        path = backup / "groups" / g / STATE_FILE
        if not g.isdigit() or not path.exists() or path.stat().st_size != entry["bytes"]:
            raise BackupError(f"{path}: missing or not {entry['bytes']} bytes")
        if not hmac.compare_digest(_sha256(path), str(entry["sha256"])):
            raise BackupError(f"{path}: SHA-256 does not match the manifest (corrupt copy)")
    return manifest


def _restore_group(
    group_dir: Path, state_file: Path, index: int, term: int, voters: dict[int, str]
) -> None:
    """One Raft group's state from ``state_file`` (at ``index``, ``term``),
    and a log that begins with a snapshot there, configured with ``voters``
    (in ``raft/``: a data group's is moved into its log store at start)."""
    snapshots = group_dir / "snapshots"
    snapshots.mkdir(parents=True)
    snap_file = snapshots / f"snap-{index}-{term}.mdb"
    shutil.copyfile(state_file, snap_file)
    sm = StateMachine(group_dir / "state")
    try:
        sm.install_snapshot(snap_file)
        sm.replace_address_book(voters)
        if sm.applied_index != index:
            raise BackupError(
                f"restored state of {group_dir} is at {sm.applied_index}, the manifest says {index}"
            )
        sm.checkpoint()  # its commits are unsynced until now
    finally:
        sm.close()
    # The installed state doubles as the Raft snapshot a lagging peer is
    # sent, with the log entries the backup carries for it (which the log
    # takes from it as it saves the snapshot: kept_log).
    snap_meta = SnapshotMeta(index, term, ConfState(frozenset(voters)))
    shutil.copyfile(group_dir / "state" / "data.mdb", snap_file)
    kept_log.carry_over(state_file, snap_file)
    with open(snap_file, "rb+") as f:
        os.fsync(f.fileno())
    store = LmdbLogStorage(group_dir / "raft")
    try:
        store.save(
            HardState(term=term, vote=0, commit=index),
            [],
            Snapshot(snap_meta, str(snap_file).encode()),
        )
    finally:
        store.close()
    # Every name made here survives a power loss before the node starts.
    for d in (snapshots, group_dir / "state", group_dir / "raft", group_dir):
        fsync_dir(d)


def restore_backup(
    data_dir: Path, backup: Path, cluster_name: str, voters: dict[int, str], key: bytes
) -> Path:
    """Make `data_dir` start from `backup` with `voters` as the configuration.

    The node must be stopped. Returns where the previous data was moved.
    Every node restored from the same backup with the same voters gets the
    same state machine (the address book is rewritten to `voters`)."""
    manifest = verify_backup(backup, cluster_name, key)
    if not voters:
        raise BackupError("restore needs the voters (ID=HOST:PORT,...)")
    aside = data_dir / f"pre-restore-{int(time.time())}"
    aside.mkdir(parents=True)
    for name in ("raft", "state", "snapshots", "state.incoming", "state.old", "state-unsynced",
                 "groups", STORES_DIR):  # fmt: skip
        if (data_dir / name).exists():
            os.replace(data_dir / name, aside / name)
    _restore_group(data_dir, backup / STATE_FILE, manifest.applied_index,
                   manifest.applied_term, voters)  # fmt: skip
    for g, entry in sorted(manifest.groups.items(), key=lambda kv: int(kv[0])):
        if entry["applied_index"]:  # a group that never applied anything starts empty
            index, term = int(entry["applied_index"]), int(entry["applied_term"])
            state = backup / "groups" / g / STATE_FILE
            _restore_group(data_dir / "groups" / g, state, index, term, voters)
    if manifest.groups:
        fsync_dir(data_dir / "groups")
    fsync_dir(data_dir)
    return aside
