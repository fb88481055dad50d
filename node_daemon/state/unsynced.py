"""The state machine commits without fsync: its log is the durable copy
(the log is compacted only up to a checkpoint, an fsync of the state), and
after the process dies the page cache still holds every commit. A host that
lost power or crashed has lost the page cache, and LMDB without sync may
then be torn (its pages reach the disk in any order: a meta page that
points at pages that never got there). Such a state is rebuilt from the
snapshot file and the log instead of being trusted.

A marker beside the state directory names the boot on which the state may
hold commits not yet synced. Invariants: the marker is on disk (fsynced,
with its name) before the state machine opens for this boot; it is removed
only after a checkpoint with nothing applied since; a marker naming another
boot means the state may be torn.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from node_daemon.storage.disk import fsync_dir, write_durably

log = logging.getLogger("roadlog.node.state")

MARKER = "state-unsynced"  # in the directory that holds ``state/``


def _marker(state_dir: Path) -> Path:
    return state_dir.parent / MARKER


def guard(state_dir: Path, boot: str) -> bool:
    """Before the state machine opens ``state_dir`` on boot ``boot``: if its
    commits may have been lost with another boot's page cache, remove it
    (the node installs its snapshot file and applies its log again) and
    return True. Then mark the state as unsynced on this boot."""
    marker = _marker(state_dir)
    try:
        marked = marker.read_text().strip()
    except FileNotFoundError:
        marked = None
    except OSError:  # unreadable: as if another boot's
        marked = ""
    torn = marked is not None and marked != boot and state_dir.exists()
    if torn:
        log.warning(
            "the host went down with state commits not synced: rebuilding the state "
            "from the snapshot and the log",
            extra={"state": str(state_dir), "marked_boot": marked, "boot": boot},
        )
        shutil.rmtree(state_dir)
        fsync_dir(state_dir.parent)
    if marked != boot:
        write_durably(marker, f"{boot}\n")
    return torn


def synced(state_dir: Path) -> None:
    """After a checkpoint at a clean stop: nothing unsynced is left."""
    marker = _marker(state_dir)
    if marker.exists():
        marker.unlink()
        fsync_dir(marker.parent)
