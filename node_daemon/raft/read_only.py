"""Pending ReadIndex requests on the leader (Raft dissertation §6.4).

A request records the commit index when it arrived; it may be answered once
a majority of voters acknowledged a heartbeat sent after it, which proves
that no newer leader had committed anything at that moment. Requests are
answered in arrival order: an acknowledgment for one covers all before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ReadRequest:
    index: int
    requester: int
    acks: set[int] = field(default_factory=set)


class ReadOnly:
    def __init__(self) -> None:
        self._pending: dict[bytes, ReadRequest] = {}  # insertion-ordered

    def add(self, context: bytes, index: int, requester: int, self_id: int) -> None:
        if context not in self._pending:
            self._pending[context] = ReadRequest(index, requester, {self_id})

    def ack(self, context: bytes, voter: int) -> set[int] | None:
        req = self._pending.get(context)
        if req is None:
            return None
        req.acks.add(voter)
        return req.acks

    def release_through(self, context: bytes) -> list[tuple[bytes, ReadRequest]]:
        """Remove and return every request up to and including ``context``."""
        out: list[tuple[bytes, ReadRequest]] = []
        for ctx in list(self._pending):
            out.append((ctx, self._pending.pop(ctx)))
            if ctx == context:
                break
        return out

    def clear(self) -> None:
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending)
