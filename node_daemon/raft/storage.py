"""The log storage contract the Raft core reads from, and an in-memory store.

The core only reads through this contract; the caller writes (``save`` with
what a Ready asks to persist, ``compact`` after taking a snapshot). The
state machine lives elsewhere: this is only the Raft log, the hard state and
the latest snapshot.

Invariants of every implementation:
- ``first_index() == snapshot().meta.index + 1``; entries are contiguous in
  ``[first_index(), last_index()]``; ``term(first_index() - 1)`` is the
  snapshot's term.
- ``save`` is atomic: after a crash either all of it is there or none.
- After ``save(..., sync=True)`` returns, it survives a crash.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from node_daemon.raft.errors import CompactedError, UnavailableError
from node_daemon.raft.types import Entry, EntryType, HardState, Snapshot


class LogStorage(Protocol):
    def initial_state(self) -> HardState:
        """The hard state last saved (all zero for a new store)."""
        ...

    def snapshot(self) -> Snapshot:
        """The latest snapshot; its index is the compaction point."""
        ...

    def first_index(self) -> int: ...

    def last_index(self) -> int: ...

    def term(self, index: int) -> int:
        """Term of ``index`` in ``[first_index() - 1, last_index()]``.

        Raises CompactedError below that range, UnavailableError above it."""
        ...

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        """Entries in ``[lo, hi)``; at least one when the range is not empty,
        then as many as fit in ``max_bytes``. Raises CompactedError when
        ``lo < first_index()`` and UnavailableError when ``hi > last_index() + 1``."""
        ...

    def config_entries(self) -> list[Entry]:
        """The CONFIG entries still in the log, in index order."""
        ...

    def save(
        self,
        hard_state: HardState | None,
        entries: Sequence[Entry],
        snapshot: Snapshot | None = None,
        sync: bool = True,
    ) -> None:
        """Persist atomically, in this order: ``snapshot`` (replaces the whole
        log), ``entries`` (any stored suffix from ``entries[0].index`` on is
        truncated first), ``hard_state``."""
        ...

    def compact(self, snapshot: Snapshot) -> None:
        """Record ``snapshot`` and drop the entries up to its index, which
        must be in ``[first_index(), last_index()]``."""
        ...


def limit_size(entries: list[Entry], max_bytes: int | None) -> list[Entry]:
    """The longest prefix of ``entries`` within ``max_bytes``, never empty."""
    if max_bytes is None or not entries:
        return entries
    total = 0
    for i, e in enumerate(entries):
        total += e.size()
        if total > max_bytes and i > 0:
            return entries[:i]
    return entries


class MemoryStorage:
    """A LogStorage in memory; a "crash" keeps it (it models the disk).

    ``_ents[0]`` is a dummy entry at the snapshot's index and term.
    """

    def __init__(self) -> None:
        self._hard = HardState()
        self._snap = Snapshot()
        self._ents: list[Entry] = [Entry(0, 0)]

    def initial_state(self) -> HardState:
        return self._hard

    def snapshot(self) -> Snapshot:
        return self._snap

    def first_index(self) -> int:
        return self._ents[0].index + 1

    def last_index(self) -> int:
        return self._ents[0].index + len(self._ents) - 1

    def term(self, index: int) -> int:
        offset = self._ents[0].index
        if index < offset:
            raise CompactedError(f"index {index} is compacted (first {offset + 1})")
        if index - offset >= len(self._ents):
            raise UnavailableError(f"index {index} is beyond the last {self.last_index()}")
        return self._ents[index - offset].term

    def entries(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        offset = self._ents[0].index
        if lo <= offset:
            raise CompactedError(f"index {lo} is compacted (first {offset + 1})")
        if hi > self.last_index() + 1:
            raise UnavailableError(f"index {hi - 1} is beyond the last {self.last_index()}")
        return limit_size(self._ents[lo - offset : hi - offset], max_bytes)

    def config_entries(self) -> list[Entry]:
        return [e for e in self._ents[1:] if e.type == EntryType.CONFIG]

    def save(
        self,
        hard_state: HardState | None,
        entries: Sequence[Entry],
        snapshot: Snapshot | None = None,
        sync: bool = True,
    ) -> None:
        if snapshot is not None:
            self._snap = snapshot
            self._ents = [Entry(snapshot.meta.term, snapshot.meta.index)]
        if entries:
            self._append(entries)
        if hard_state is not None:
            self._hard = hard_state

    def _append(self, entries: Sequence[Entry]) -> None:
        offset = self._ents[0].index
        first = entries[0].index
        if first <= offset:
            # Entries already covered by the snapshot: skip them.
            entries = [e for e in entries if e.index > offset]
            if not entries:
                return
            first = entries[0].index
        if first > self.last_index() + 1:
            raise ValueError(f"gap: appending {first} after {self.last_index()}")
        del self._ents[first - offset :]
        self._ents.extend(entries)

    def compact(self, snapshot: Snapshot) -> None:
        index = snapshot.meta.index
        offset = self._ents[0].index
        if index <= offset:
            return
        if index > self.last_index():
            raise UnavailableError(f"compact {index} beyond the last {self.last_index()}")
        term = self._ents[index - offset].term
        self._ents = [Entry(term, index), *self._ents[index - offset + 1 :]]
        self._snap = snapshot
