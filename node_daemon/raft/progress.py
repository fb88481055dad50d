"""The leader's view of each follower: how far it matches, what to send next,
and how many appends are in flight (the pipelining window).

States: PROBE (send one append, wait for its answer: we do not know where
the follower's log matches), REPLICATE (stream appends optimistically, up to
the in-flight window), SNAPSHOT (a snapshot is on its way; send nothing).
Invariant: ``match < next``.
"""

from __future__ import annotations

from collections import deque
from enum import IntEnum


class ProgressState(IntEnum):
    PROBE = 0
    REPLICATE = 1
    SNAPSHOT = 2


class Inflights:
    """Appends sent but not acknowledged, bounded in count and in bytes."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._items: deque[tuple[int, int]] = deque()  # (last index, bytes)
        self.bytes = 0

    def add(self, last_index: int, nbytes: int) -> None:
        self._items.append((last_index, nbytes))
        self.bytes += nbytes

    def free_le(self, index: int) -> None:
        """Forget every append whose last index is <= ``index``."""
        items = self._items
        while items and items[0][0] <= index:
            self.bytes -= items.popleft()[1]

    def free_first(self) -> None:
        if self._items:
            self.bytes -= self._items.popleft()[1]

    def reset(self) -> None:
        self._items.clear()
        self.bytes = 0

    def full(self) -> bool:
        return len(self._items) >= self.max_count or self.bytes >= self.max_bytes

    def __len__(self) -> int:
        return len(self._items)


class Progress:
    __slots__ = (
        "catch_up_mark",
        "catching_up",
        "commit_sent",
        "heard_at",
        "inflights",
        "is_learner",
        "match",
        "next",
        "pending_snapshot",
        "probe_sent",
        "recent_active",
        "state",
    )

    def __init__(
        self, next_index: int, max_inflight: int, max_inflight_bytes: int, is_learner: bool
    ) -> None:
        self.match = 0
        self.next = next_index
        self.commit_sent = 0  # the highest commit index the follower was sent
        self.state = ProgressState.PROBE
        self.probe_sent = False
        self.pending_snapshot = 0
        self.recent_active = False
        self.heard_at = -1  # the leader's tick count when this node last answered it (-1: never)
        self.is_learner = is_learner
        # The follower says it lost its storage and is catching up: it is
        # replicated to, but counts in no commit or read quorum (RaftCore._caught_up).
        self.catching_up = False
        self.catch_up_mark = 0  # the entry whose commit proves the leader current to it
        self.inflights = Inflights(max_inflight, max_inflight_bytes)

    def _reset(self, state: ProgressState) -> None:
        self.probe_sent = False
        self.pending_snapshot = 0
        self.state = state
        self.inflights.reset()

    def become_probe(self) -> None:
        if self.state == ProgressState.SNAPSHOT:
            pending = self.pending_snapshot
            self._reset(ProgressState.PROBE)
            self.next = max(self.match + 1, pending + 1)
        else:
            self._reset(ProgressState.PROBE)
            self.next = self.match + 1

    def become_replicate(self) -> None:
        self._reset(ProgressState.REPLICATE)
        self.next = self.match + 1

    def become_snapshot(self, snapshot_index: int) -> None:
        self._reset(ProgressState.SNAPSHOT)
        self.pending_snapshot = snapshot_index

    def maybe_update(self, index: int) -> bool:
        """The follower matches up to ``index``; returns True if that is news."""
        updated = False
        if self.match < index:
            self.match = index
            updated = True
            self.probe_sent = False
        self.next = max(self.next, index + 1)
        return updated

    def sent_entries(self, last_index: int, nbytes: int) -> None:
        """Record an append carrying entries up to ``last_index``."""
        if self.state == ProgressState.REPLICATE:
            if last_index >= self.next:
                self.next = last_index + 1
                self.inflights.add(last_index, nbytes)
        elif self.state == ProgressState.PROBE:
            self.probe_sent = True

    def maybe_decr_to(self, rejected: int, match_hint: int, lost_log: bool = False) -> bool:
        """Handle a rejection of the append at ``rejected``; False if stale.

        A rejection at exactly ``match`` from a follower that says it lost
        its log (``lost_log``: it is catching up after a wiped disk or a
        damaged log) means it no longer holds what it acknowledged: ``match``
        starts over from 0. From any other follower it is stale (a rejection
        of a later append that arrived before the append it acknowledged
        since; starting over for it re-sent the whole log, found by the
        simulation's seed 4264). Lowering ``match`` never lowers the commit
        index."""
        lost = lost_log and self.match > 0 and rejected == self.match
        if self.state == ProgressState.REPLICATE:
            if rejected <= self.match and not lost:
                return False
            if lost:
                self.match = 0
            self.next = self.match + 1
            return True
        if self.next - 1 != rejected:
            return False  # not the probe we are waiting for
        if lost:
            self.match = 0
        self.next = max(min(rejected, match_hint + 1), self.match + 1)
        self.probe_sent = False
        return True

    def is_paused(self) -> bool:
        if self.state == ProgressState.PROBE:
            return self.probe_sent
        if self.state == ProgressState.REPLICATE:
            return self.inflights.full()
        return True
