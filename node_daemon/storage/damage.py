"""A Raft group's files as a disk may leave them: checked before a node
trusts them, set aside when damaged.

LMDB maps its data file and trusts it. A file shorter than the pages its
current meta page counts (truncated by the disk or its filesystem) kills the
process with SIGBUS at the first read of a missing page, so the size is
checked before LMDB opens it; as a healthy file may be a little shorter
(pages LMDB allocated and freed in one transaction are never written), a
log that fails the check is read whole in a child process first, and only
one that kills the child or reads as damaged there is damaged. A meta page
that is not LMDB's is an error at open. Entries whose bytes changed are
caught by their checksum (``LmdbLogStorage.verify``).

A damaged log cannot be repaired here, and a node must never vote or serve
from it: it is moved aside (the damaged log kept for the operator, under
``corrupt-<time>/``, the newest two such copies; the state and snapshots
made from it are dropped) and the node starts that group with an empty
log, as a wiped node does: catching up, voting only once a leader has
caught it up (see ``replica/replica.py``). A damaged state is rebuilt from the
snapshot and the log instead. Invariants: nothing is deleted before it is
out of the group's way; what is set aside is durable (its directory
fsynced) before the empty log is made.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import lmdb

from node_daemon.raft import HardState
from node_daemon.storage.disk import fsync_dir
from node_daemon.storage.raft_log import LmdbLogStorage

log = logging.getLogger("roadlog.node.damage")

# The 64-bit LMDB meta page: a 16-byte page header, then magic, version,
# address, map size, two 48-byte database records (the first's md_pad holds
# the page size), the last page number and the transaction id.
_MAGIC, _VERSION = 0xBEEFC0DE, 1
_META = struct.Struct("<IIQQ")
_PSIZE_AT = 16 + _META.size  # dbs[0].md_pad
_LAST_AT = 16 + _META.size + 2 * 48  # mm_last_pg, then mm_txnid
# What LMDB raises for a file that is not an LMDB environment, or damaged.
LMDB_DAMAGE = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError)
# A group's files that hold its log and what was made from it (all but the
# log are dropped once set aside).
GROUP_FILES = ("raft", "state", "state.incoming", "state.old", "snapshots", "state-unsynced")


def _metas(head: bytes) -> list[tuple[int, int, int]]:
    """(txnid, last page, page size) of each LMDB meta page in ``head``."""
    metas = []
    if len(head) >= _LAST_AT + 16:
        (psize,) = struct.unpack_from("<I", head, _PSIZE_AT)
        for off in (0, psize):
            if 4096 <= psize <= 65536 and off + _LAST_AT + 16 <= len(head):
                magic, version, _, _ = _META.unpack_from(head, off + 16)
                last_pg, txnid = struct.unpack_from("<QQ", head, off + _LAST_AT)
                if magic == _MAGIC and version == _VERSION:
                    metas.append((txnid, last_pg, psize))
    return metas


def truncated(directory: Path) -> str:
    """Why the LMDB data file in ``directory`` cannot be mapped safely
    ('' when it can, or when there is none yet)."""
    path = directory / "data.mdb"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(2 * 65536)
    except OSError:
        return ""  # missing, or unreadable: LMDB's open says so, loudly
    if size == 0:
        return ""  # made, never written: LMDB writes it anew
    metas = _metas(head)
    if not metas:
        return f"{path} has no LMDB meta page"
    _, last_pg, psize = max(metas)
    need = (last_pg + 1) * psize
    if size < need:
        return f"{path} is truncated: {size} bytes, its meta page counts {need}"
    return ""


def read_in_child(raft: Path) -> str:
    """Open the log in ``raft`` and read every entry in a child process:
    why it is damaged ('' if it reads whole). A SIGBUS kills the child, not
    this process. A log that reads whole is then rewritten (the child
    copies every record into a new file, and checks the copy): pages
    missing at the end of its file may still be LMDB's free list, whose
    next use killed the node with SIGBUS (finding 16: a file cut by one
    page passed this check, then the node's first write died)."""
    compact = raft / "compact.tmp"
    shutil.rmtree(compact, ignore_errors=True)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from node_daemon.storage.raft_log import LmdbLogStorage\n"
        "s = LmdbLogStorage(sys.argv[1])\n"
        "bad = s.verify()\n"
        "if not bad:\n"
        "    s.copy_records(Path(sys.argv[2]))\n"
        "    s.close()\n"
        "    bad = LmdbLogStorage(sys.argv[2]).verify()\n"
        "print(bad)\n"
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, str(raft), str(compact)],
            capture_output=True, text=True, timeout=600,
            cwd=str(Path(__file__).resolve().parents[1]),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "reading the log whole took over 600 s"
    if r.returncode < 0:
        return f"reading the log killed a process ({signal.Signals(-r.returncode).name})"
    if r.returncode != 0:
        return f"the log cannot be read: {r.stderr.strip().splitlines()[-1:]}"
    bad = int(r.stdout.split()[-1]) if r.stdout.split() else -1
    if bad:
        return f"entry {bad} of the log is corrupt or missing"
    os.replace(compact / "data.mdb", raft / "data.mdb")
    fsync_dir(raft)
    shutil.rmtree(compact, ignore_errors=True)
    log.warning("the log's data file was shorter than its pages: rewritten",
                extra={"dir": str(raft)})  # fmt: skip
    return ""


KEEP_SET_ASIDE = 2  # damaged copies kept for a post-mortem, the newest first


def set_aside(group_dir: Path, why: str) -> Path | None:
    """Move the group's log, state and snapshots into a new
    ``corrupt-<time>`` directory beside them, then drop from it all but the
    damaged log (the state and snapshots were made from it, and the node
    fetches them again as it catches up); returns it. Only the newest
    KEEP_SET_ASIDE such directories are kept: a disk that damages logs
    again and again filled with whole copies of the group (RELIABILITY.md,
    finding 14). On a disk with no room even for that directory, the
    damaged files are removed instead (None): the copy is for a post-mortem
    only, and the node must start and catch up (finding 20)."""
    _drop_old_copies(group_dir, keep=KEEP_SET_ASIDE - 1)
    aside = group_dir / f"corrupt-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    n = 0
    while aside.exists():
        n += 1
        aside = aside.with_name(f"{aside.name.split('.')[0]}.{n}")
    try:
        aside.mkdir(parents=True)
        (aside / "why").write_text(why + "\n")
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        shutil.rmtree(aside, ignore_errors=True)
        _remove(group_dir, GROUP_FILES)
        log.error(
            "no room to keep a copy of the damaged log: removed it",
            extra={"dir": str(group_dir), "why": why},
        )
        return None
    for name in GROUP_FILES:
        if (group_dir / name).exists():
            os.replace(group_dir / name, aside / name)
    fsync_dir(aside)
    fsync_dir(group_dir)
    # Out of the group's way first, then dropped.
    _remove(aside, [name for name in GROUP_FILES if name != "raft"])
    return aside


def _remove(directory: Path, names: Iterable[str]) -> None:
    """Remove ``names`` (files or trees) from ``directory``, then make that last."""
    for name in names:
        path = directory / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    fsync_dir(directory)


def _copies(root: Path, patterns: Iterable[str]) -> list[Path]:
    """The set-aside copies under ``root`` matching ``patterns``, oldest first."""
    found = (d for p in patterns for d in root.glob(p) if d.is_dir())
    return sorted(found, key=lambda d: (d.stat().st_mtime_ns, d.name))


def _drop_old_copies(group_dir: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` set-aside copies of the group."""
    copies = _copies(group_dir, ["corrupt-*"])
    for old in copies[: max(0, len(copies) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
        log.warning("removed an old set-aside copy of a damaged log", extra={"dir": str(old)})


def drop_set_aside(data_dir: Path) -> int:
    """Make room: remove every set-aside copy of a damaged log under the
    node's data directory (group 0's and each data group's), oldest first.
    They are kept for a post-mortem only, and yield to the data the node
    must store (RELIABILITY.md, finding 19: two copies of a 235 MB log
    filled a node's disk, which then could apply nothing). Returns the
    bytes freed."""
    freed = 0
    for d in _copies(data_dir, ["corrupt-*", "groups/*/corrupt-*", "logs/corrupt-*"]):
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            freed += size
            log.warning(
                "out of space: removed a set-aside copy of a damaged log",
                extra={"dir": str(d), "bytes": size},
            )
    return freed


class DamagedLogError(Exception):
    """The log is damaged and no peer can catch this node up: setting it
    aside would lose everything; an operator restores from a backup."""


def open_log(
    group_dir: Path, group: int = 0, can_catch_up: bool = True
) -> tuple[LmdbLogStorage, str, HardState]:
    """The group's log, checked whole (size, LMDB's pages, every entry's
    checksum); a damaged one is set aside and an empty log opened instead
    (``DamagedLogError`` where no peer ``can_catch_up`` this node). Returns
    the log, why the old one was set aside ('' if it was not), and the old
    log's hard state where it could still be read (term and vote: a node
    that held a copy never looks like a new one to its peers)."""
    raft = group_dir / "raft"
    why = truncated(raft)
    if why:  # a suspicion: read whole where a SIGBUS cannot kill this process
        child = read_in_child(raft)
        why = f"{why}; {child}" if child else ""
    store: LmdbLogStorage | None = None
    if not why:
        t0 = time.monotonic()
        try:
            store = LmdbLogStorage(raft)
            bad = store.verify()
            if bad:
                why = f"entry {bad} of the log is corrupt or missing"
        except LMDB_DAMAGE as e:
            why = f"LMDB cannot read the log: {e}"
        except (struct.error, ValueError) as e:  # its hard state or snapshot record
            why = f"the log's records cannot be read: {e}"
        log.debug("log checked", extra={"group": group, "s": round(time.monotonic() - t0, 3)})
    if not why:
        assert store is not None
        return store, "", HardState()
    kept = HardState()
    if store is not None:
        kept = store.initial_state()
        store.close()
    if not can_catch_up:
        raise DamagedLogError(
            f"the log of group {group} in {raft} is damaged ({why}) and no peer can catch "
            "this node up: restore it from a backup (roadlog-node restore)"
        )
    aside = set_aside(group_dir, why)
    log.error(
        "the log is damaged: set aside; this group starts empty and catches up",
        extra={"group": group, "why": why, "aside": str(aside)},
    )
    return LmdbLogStorage(raft), why, kept


def state_damage(state_dir: Path) -> str:
    """Why the state in ``state_dir`` cannot be opened safely ('' if it can)."""
    why = truncated(state_dir)
    if why or not (state_dir / "data.mdb").exists():
        return why
    try:
        env = lmdb.open(str(state_dir), readonly=True, lock=False, max_dbs=16)
    except LMDB_DAMAGE as e:
        return f"LMDB cannot read the state: {e}"
    env.close()
    return ""
