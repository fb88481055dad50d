"""A read-only view of a state replica that another process of this node
applies (worker processes, docs/multiraft.md step 5): the main process
reads the data groups' replicas for fetches, topic offsets and give-to-get,
and a worker reads group 0's for topics and producer ids.

LMDB's readers span processes: the view opens the replica's environment
read-only (with its lock file, so the writer never reuses a page a read
here still sees) and reads what the writer committed, synced or not.

A snapshot install replaces the replica's directory whole
(``StateMachine.install_snapshot``); an environment opened before goes on
reading the old, unlinked files, consistent but frozen. ``current`` notices
(the data file is another file now) and opens the new one; a request keeps
the ``StateMachine`` it began with, which stays readable while it holds it.

Invariants: ``current`` never returns a replica older than one it returned
before (a directory rebuilt from an older snapshot at its writer's start is
"not ready" until it has applied as far again), so a read fenced at an
index it saw applied sees at least that; the view never writes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import lmdb

from node_daemon.state.machine import StateMachine
from node_daemon.storage.disk import data_file_identity
from node_daemon.storage.group_logs import GroupLogReader
from node_daemon.storage.raft_log import LogReader
from roadlog.errors import Code, RoadlogError

POLL_FIRST_S = 0.001  # waiting for an index: first look again after this,
POLL_MAX_S = 0.01  # doubling up to this


class _NotReady(RoadlogError):
    """UNAVAILABLE: the replica is not there, or behind, for now."""


class StateReplicaView:
    """``path``: the replica's state directory (``groups/<g>/state``)."""

    def __init__(self, path: Path, group: int) -> None:
        self.path = path
        self.group = group
        self._sm: StateMachine | None = None
        self._file: tuple[int, int] | None = None  # (device, inode) of the open data file
        self._highest = 0  # the highest applied index seen
        # The replica's batches are references into its Raft log (group
        # 0's beside the state directory; a data group's in a log store),
        # read here read-only too.
        self._log: LogReader | GroupLogReader = (
            LogReader(path.parent / "raft") if group == 0 else GroupLogReader(path.parent, group)
        )

    def _unavailable(self, why: str) -> _NotReady:
        return _NotReady(
            Code.UNAVAILABLE, f"group {self.group}'s replica on this node is {why}: try again"
        )

    def current(self) -> StateMachine:
        """The replica as it is now, opened read-only (UNAVAILABLE while it
        is not there, or is behind what this view saw before)."""
        ident = data_file_identity(self.path)
        if ident is None:
            raise self._unavailable("not there yet")
        if self._sm is None or ident != self._file:
            try:
                sm = StateMachine(self.path, group=self.group, readonly=True, entries=self._log)
            except (lmdb.Error, FileNotFoundError) as e:  # replaced as it was opened
                raise self._unavailable(f"being replaced ({e})") from None
            if data_file_identity(self.path) != ident:
                # Replaced between the look and the opening: which file this
                # is, is not known; the next call opens the new one.
                sm.close()
                raise self._unavailable("being replaced")
            # The old one is not closed: a request may still read it; it
            # closes when the last of them lets it go.
            self._sm, self._file = sm, ident
        if self.applied(self._sm) < self._highest:
            raise self._unavailable("rebuilding")
        return self._sm

    def applied(self, sm: StateMachine) -> int:
        """``sm``'s applied index as its writer last committed it (also set
        as ``sm.applied_index``)."""
        index = sm.stored_applied_index()
        sm.applied_index = index  # what readers of ``sm.applied_index`` see
        self._highest = max(self._highest, index)
        return index

    async def wait_applied(self, index: int, timeout: float) -> StateMachine:
        """The replica once it applied ``index``: UNAVAILABLE after
        ``timeout`` seconds. Read the answer from the machine returned (it
        applied ``index``), not from a later ``current``."""
        deadline = time.monotonic() + timeout
        pause = POLL_FIRST_S
        while True:
            try:
                sm = self.current()
                at = self.applied(sm)
                if at >= index:
                    return sm
                not_ready = self._unavailable(f"at index {at}, not yet {index}")
            except _NotReady as e:
                not_ready = e
            if time.monotonic() + pause > deadline:
                raise not_ready
            await asyncio.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
