"""The Raft log as the core sees it: stable entries (in storage) followed by
unstable ones (appended here, not yet persisted), plus commit and apply marks.

Invariants: ``applied <= applying <= committed <= last_index()`` (``applying``:
the last committed entry handed to the caller to apply); the unstable part
starts right after the stable part (or after a pending snapshot).
"""

from __future__ import annotations

from node_daemon.raft.errors import CompactedError, UnavailableError
from node_daemon.raft.storage import LogStorage, limit_size
from node_daemon.raft.types import Entry, Snapshot


class Unstable:
    """Entries and a snapshot the caller has been handed but not yet persisted."""

    def __init__(self, offset: int) -> None:
        self.snapshot: Snapshot | None = None
        self.entries: list[Entry] = []
        self.offset = offset  # index of entries[0]

    def maybe_first_index(self) -> int | None:
        return self.snapshot.meta.index + 1 if self.snapshot is not None else None

    def maybe_last_index(self) -> int | None:
        if self.entries:
            return self.offset + len(self.entries) - 1
        return self.snapshot.meta.index if self.snapshot is not None else None

    def maybe_term(self, index: int) -> int | None:
        if index < self.offset:
            if self.snapshot is not None and self.snapshot.meta.index == index:
                return self.snapshot.meta.term
            return None
        last = self.maybe_last_index()
        if last is None or index > last:
            return None
        return self.entries[index - self.offset].term

    def stable_to(self, index: int, term: int) -> None:
        """Entries up to ``index`` (of ``term``) are now persisted."""
        t = self.maybe_term(index)
        if t is None or t != term or index < self.offset:
            return  # overwritten since that Ready: keep them
        del self.entries[: index + 1 - self.offset]
        self.offset = index + 1

    def stable_snap_to(self, index: int) -> None:
        if self.snapshot is not None and self.snapshot.meta.index == index:
            self.snapshot = None

    def restore(self, snap: Snapshot) -> None:
        self.offset = snap.meta.index + 1
        self.entries = []
        self.snapshot = snap

    def truncate_and_append(self, ents: list[Entry]) -> None:
        first = ents[0].index
        if first == self.offset + len(self.entries):
            self.entries.extend(ents)
        elif first <= self.offset:
            self.offset = first
            self.entries = list(ents)
        else:
            del self.entries[first - self.offset :]
            self.entries.extend(ents)

    def slice(self, lo: int, hi: int) -> list[Entry]:
        return self.entries[lo - self.offset : hi - self.offset]


class RaftLog:
    def __init__(self, storage: LogStorage, max_apply_bytes: int | None = None) -> None:
        self.storage = storage
        first = storage.first_index()
        last = storage.last_index()
        self.unstable = Unstable(last + 1)
        self.committed = first - 1
        self.applied = first - 1
        self.applying = first - 1
        self.max_apply_bytes = max_apply_bytes

    # -- positions ---------------------------------------------------------

    def first_index(self) -> int:
        i = self.unstable.maybe_first_index()
        return i if i is not None else self.storage.first_index()

    def last_index(self) -> int:
        i = self.unstable.maybe_last_index()
        return i if i is not None else self.storage.last_index()

    def term(self, index: int) -> int:
        """Term at ``index``; raises CompactedError/UnavailableError outside."""
        dummy = self.first_index() - 1
        if index < dummy:
            raise CompactedError(f"index {index} is compacted")
        if index > self.last_index():
            raise UnavailableError(f"index {index} is not in the log")
        t = self.unstable.maybe_term(index)
        if t is not None:
            return t
        return self.storage.term(index)

    def term_or_zero(self, index: int) -> int:
        try:
            return self.term(index)
        except (CompactedError, UnavailableError):
            return 0

    def last_term(self) -> int:
        return self.term(self.last_index())

    def match_term(self, index: int, term: int) -> bool:
        try:
            return self.term(index) == term
        except (CompactedError, UnavailableError):
            return False

    def is_up_to_date(self, last_index: int, term: int) -> bool:
        """The election restriction (§5.4.1): is a log ending at
        (last_index, term) at least as up to date as ours?"""
        my_term = self.last_term()
        return term > my_term or (term == my_term and last_index >= self.last_index())

    # -- appending ---------------------------------------------------------

    def append(self, ents: list[Entry]) -> int:
        if not ents:
            return self.last_index()
        if ents[0].index - 1 < self.committed:
            raise AssertionError(
                f"appending at {ents[0].index} would overwrite committed {self.committed}"
            )
        self.unstable.truncate_and_append(ents)
        return self.last_index()

    def find_conflict(self, ents: tuple[Entry, ...]) -> int:
        """The index of the first entry that is new or conflicts, else 0."""
        for e in ents:
            if not self.match_term(e.index, e.term):
                return e.index
        return 0

    def find_conflict_by_term(self, index: int, term: int) -> tuple[int, int]:
        """The largest (i, t) with i <= index and t <= term in our log: a
        follower's hint that lets the leader skip a whole term at once."""
        index = min(index, self.last_index())
        while index > 0:
            try:
                t = self.term(index)
            except CompactedError:
                return index, 0
            if t <= term:
                return index, t
            index -= 1
        return 0, 0

    def maybe_append(
        self, index: int, log_term: int, committed: int, ents: tuple[Entry, ...]
    ) -> tuple[int, int, bool]:
        """Handle an APPEND: returns (conflict_at, last_new_index, accepted).

        Entries already present are kept; from the first conflict on, our
        suffix is replaced. ``conflict_at`` is 0 when nothing was truncated.
        """
        if not self.match_term(index, log_term):
            return 0, 0, False
        last_new = index + len(ents)
        conflict = self.find_conflict(ents)
        truncated = 0
        if conflict:
            if conflict <= self.committed:
                raise AssertionError(f"entry {conflict} conflicts with committed {self.committed}")
            if conflict <= self.last_index():
                truncated = conflict
            self.append(list(ents[conflict - index - 1 :]))
        self.commit_to(min(committed, last_new))
        return truncated, last_new, True

    # -- commit and apply --------------------------------------------------

    def commit_to(self, index: int) -> None:
        if index > self.committed:
            if index > self.last_index():
                raise AssertionError(f"commit {index} beyond last {self.last_index()}")
            self.committed = index

    def maybe_commit(self, index: int, term: int) -> bool:
        """Commit ``index`` if it is from ``term`` (only current-term entries
        are committed by counting replicas, §5.4.2)."""
        if index > self.committed and self.term_or_zero(index) == term:
            self.commit_to(index)
            return True
        return False

    def applied_to(self, index: int) -> None:
        """Everything up to ``index`` is applied (never moves back)."""
        if index > self.applied:
            if index > self.committed:
                raise AssertionError(f"applied {index} beyond committed {self.committed}")
            self.applied = index
            self.applying = max(self.applying, index)

    def has_next_committed(self, upto: int | None = None) -> bool:
        hi = self.committed if upto is None else min(self.committed, upto)
        return hi > max(self.applying, self.first_index() - 1)

    def next_committed(self, upto: int | None = None) -> list[Entry]:
        """Committed entries not handed out yet (up to ``upto``, within
        ``max_apply_bytes``); they count as handed out from now on."""
        hi = self.committed if upto is None else min(self.committed, upto)
        lo = max(self.applying + 1, self.first_index())
        if hi + 1 > lo:
            ents = self.slice(lo, hi + 1, self.max_apply_bytes)
            self.applying = ents[-1].index
            return ents
        return []

    # -- reading -----------------------------------------------------------

    def slice(self, lo: int, hi: int, max_bytes: int | None = None) -> list[Entry]:
        """Entries in ``[lo, hi)``, at least one if any, within ``max_bytes``."""
        if lo >= hi:
            return []
        if lo < self.first_index():
            raise CompactedError(f"index {lo} is compacted")
        if hi > self.last_index() + 1:
            raise UnavailableError(f"index {hi - 1} is not in the log")
        ents: list[Entry] = []
        uoff = self.unstable.offset
        if lo < uoff:
            ents = self.storage.entries(lo, min(hi, uoff), max_bytes)
            if len(ents) < min(hi, uoff) - lo:
                return ents  # cut by the size limit
        if hi > uoff:
            ents = ents + self.unstable.slice(max(lo, uoff), hi)
        return limit_size(ents, max_bytes)

    def entries_from(
        self, index: int, max_bytes: int | None, max_count: int | None = None
    ) -> list[Entry]:
        """Entries from ``index`` on, at most ``max_count`` and ``max_bytes``
        (but at least one when there are any)."""
        hi = self.last_index() + 1
        if index >= hi:
            return []
        if max_count is not None:
            hi = min(hi, index + max_count)
        return self.slice(index, hi, max_bytes)

    def snapshot(self) -> Snapshot:
        if self.unstable.snapshot is not None:
            return self.unstable.snapshot
        return self.storage.snapshot()

    def restore(self, snap: Snapshot) -> None:
        self.committed = snap.meta.index
        self.unstable.restore(snap)
