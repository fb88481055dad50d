"""Proposals a leader put into its own log, waiting for their outcome.

Sans-I/O: the node (futures of the callers) and the simulation (queue items
of its workers) keep their waiters here and are told which to answer.

Invariant: every proposal added is handed back exactly once, either as
*applied* (the entry applied at its index carries its term: its results are
the answer) or as *lost* (some other entry was applied there, or its entry
left this node's log: overwritten by a newer leader's, cut away past the new
end, or covered by an installed snapshot). A lost proposal may still be
committed elsewhere (an uncommitted entry can survive on another node); a
caller that hears "lost" must treat the outcome as unknown and retry with
the same producer sequence, which the state machine stores once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from node_daemon.raft.types import Entry

W = TypeVar("W")


class TermsOfLog(Protocol):
    """What ``PendingProposals.lost`` reads of the Raft log."""

    def first_index(self) -> int: ...

    def last_index(self) -> int: ...

    def term_or_zero(self, index: int) -> int: ...


@dataclass(slots=True)
class _Proposal(Generic[W]):
    term: int
    waiter: W


class PendingProposals(Generic[W]):
    """Waiters by log index: one per entry this node proposed as leader."""

    def __init__(self) -> None:
        self._by_index: dict[int, _Proposal[W]] = {}
        self._highest = 0

    def __len__(self) -> int:
        return len(self._by_index)

    def add(self, index: int, term: int, waiter: W) -> None:
        """``waiter`` waits for the entry proposed at ``index`` in ``term``."""
        assert index not in self._by_index, f"two proposals at index {index}"
        self._by_index[index] = _Proposal(term, waiter)
        self._highest = max(self._highest, index)

    def applied(self, entries: Iterable[Entry]) -> tuple[list[tuple[Entry, W]], list[W]]:
        """``entries`` (in index order) were applied: the waiters whose entry
        it was, each with it, and the waiters lost at or below the last
        index (another entry took their place)."""
        mine: list[tuple[Entry, W]] = []
        lost: list[W] = []
        last = 0
        for e in entries:
            last = e.index
            p = self._by_index.pop(e.index, None)
            if p is None:
                continue
            if p.term == e.term:
                mine.append((e, p.waiter))
            else:
                lost.append(p.waiter)
        if self._by_index and last:
            for idx in [i for i in self._by_index if i <= last]:
                lost.append(self._by_index.pop(idx).waiter)
        return mine, lost

    def may_be_lost(self, first_written: int | None, snapshot: bool) -> bool:
        """Whether a log write starting at ``first_written`` (or installing a
        snapshot) can have replaced any waiting proposal's entry; False for
        a leader's own appends past everything it waits for."""
        if not self._by_index:
            return False
        return snapshot or (first_written is not None and first_written <= self._highest)

    def lost(self, log: TermsOfLog) -> list[W]:
        """Remove and return the waiters whose entry is no longer in ``log``
        at its index with its term."""
        first, last = log.first_index(), log.last_index()
        gone = [
            i
            for i, p in self._by_index.items()
            if i < first or i > last or log.term_or_zero(i) != p.term
        ]
        return [self._by_index.pop(i).waiter for i in gone]

    def drain(self) -> list[W]:
        """Remove and return every waiter (the node stops)."""
        out = [p.waiter for p in self._by_index.values()]
        self._by_index.clear()
        return out
