"""Opening one group's storage on this node (``Replica``'s start): its
Raft log, its state machine, and whether it must catch up first.

Invariants: a log the disk damaged is set aside and the group starts
empty and catches up (a node with no peer to catch it up refuses to
start); a state whose unsynced commits a power loss may have torn, or that
the disk damaged, is rebuilt from the snapshot and the log; a state behind
the log's snapshot (a crash between saving a snapshot and installing it)
installs it before anything else reads the state."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_daemon import metrics
from node_daemon.config import NodeConfig
from node_daemon.replica import catching_up
from node_daemon.state import unsynced
from node_daemon.state.machine import StateMachine
from node_daemon.storage import damage
from node_daemon.storage.boot import boot_id
from node_daemon.storage.group_logs import open_group_log
from node_daemon.storage.log_store import LogStore
from node_daemon.storage.raft_log import LmdbLogStorage

log = logging.getLogger("roadlog.node")


@dataclass
class OpenedGroup:
    log: LmdbLogStorage
    set_aside: str  # why the damaged log was set aside ("": it was not): this group starts empty
    boot: str
    state_rebuilt: bool
    sm: StateMachine
    behind: bool  # catching up before it may vote
    catching_up_file: Path | None  # its marker while catching up
    snapshot_gauge: Any  # the group's snapshot index gauge, set


def open_group(
    cfg: NodeConfig, group: int, data: Path, store: LogStore | None = None
) -> OpenedGroup:
    """Open group ``group``'s log and state under ``data``; its log in
    ``store`` where given (a data group), else in ``data/raft``."""
    alone = bool(cfg.peers) and set(cfg.peers) <= {cfg.node_id}
    if store is None:
        log_store, set_aside, kept = damage.open_log(data, group, not alone)
    else:
        log_store, set_aside, kept = open_group_log(store, group, data, not alone)
    if set_aside:
        metrics.DAMAGED_LOGS_SET_ASIDE.labels(str(group)).inc()
    boot = boot_id(Path(cfg.boot_id_file))
    rebuilt = unsynced.guard(data / "state", boot)
    why = damage.state_damage(data / "state")
    if why:
        log.error("the state is damaged: rebuilding it", extra={"group": group, "why": why})
        shutil.rmtree(data / "state")
        rebuilt = True
    if rebuilt:
        metrics.STATES_REBUILT.labels(str(group)).inc()
    # Producer ids are issued in group 0; a data group's leader checks them there.
    # Its batches are stored as references into this log (one copy per
    # node: docs/one-copy.md).
    sm = StateMachine(data / "state", issues_producers=group == 0, group=group, entries=log_store)
    marker = data / "raft" / catching_up.CATCHING_UP_FILE
    behind = catching_up.start(
        log_store, cfg.peers, cfg.node_id, group, marker, kept if set_aside else None
    )
    snap = log_store.snapshot()
    gauge = (
        metrics.SNAPSHOT_INDEX if group == 0 else metrics.GROUP_SNAPSHOT_INDEX.labels(str(group))
    )
    gauge.set(snap.meta.index)
    if sm.applied_index < snap.meta.index:
        sm.install_snapshot(snap.data.decode())  # crashed between saving and installing it
    return OpenedGroup(
        log_store, set_aside, boot, rebuilt, sm, behind, marker if behind else None, gauge
    )
