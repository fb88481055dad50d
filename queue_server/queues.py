"""The queue server's core, sans-I/O: a write queue only the leader drains,
and a read queue any node may steal from once it has applied the read's
fence. Nodes pull: each grants credit, and work is handed out only against
it, so a busy node takes less and an idle one steals more.

Time is passed in (``now``, in seconds); nothing here blocks or does I/O.
Invariants: an item is queued, handed to exactly one worker, or finished;
work a worker took and did not finish goes back to the front of its queue
when that worker leaves; queued items whose deadline passed are dropped and
reported; the queues never hold more than their bounds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum


class Kind(IntEnum):
    WRITE = 1
    READ = 2


class QueueFull(Exception):
    """The queue is at its bound; the client should back off."""


@dataclass(slots=True)
class Item:
    id: int
    kind: Kind
    method: str
    request: bytes
    deadline: float
    enqueued: float
    fence: int = 0
    attempts: int = 0


@dataclass(slots=True)
class Worker:
    id: int
    node_id: int
    is_leader: bool = False
    term: int = 0
    applied: int = 0
    write_credit: int = 0
    read_credit: int = 0
    inflight: dict[int, Item] = field(default_factory=dict)
    taken_writes: int = 0
    taken_reads: int = 0


@dataclass(slots=True)
class Expired:
    item: Item
    reason: str


class WorkQueues:
    def __init__(self, max_writes: int = 10_000, max_reads: int = 10_000) -> None:
        self.max = {Kind.WRITE: max_writes, Kind.READ: max_reads}
        self.queues: dict[Kind, deque[Item]] = {Kind.WRITE: deque(), Kind.READ: deque()}
        self.workers: dict[int, Worker] = {}
        self._rr = 0  # rotates ties between equally idle readers

    # ------------------------------------------------------------ clients

    def submit(self, item: Item) -> None:
        q = self.queues[item.kind]
        if len(q) >= self.max[item.kind]:
            raise QueueFull(f"the {item.kind.name.lower()} queue is full ({len(q)} waiting)")
        q.append(item)

    def cancel(self, item_id: int) -> bool:
        """A client gave up: forget the item if it is still queued."""
        for q in self.queues.values():
            for it in q:
                if it.id == item_id:
                    q.remove(it)
                    return True
        return False

    def expire(self, now: float) -> list[Expired]:
        """Drop queued items whose deadline passed."""
        out: list[Expired] = []
        for kind, q in self.queues.items():
            if not any(it.deadline <= now for it in q):
                continue
            keep: deque[Item] = deque()
            for it in q:
                if it.deadline <= now:
                    out.append(Expired(it, self._why_waiting(kind, it)))
                else:
                    keep.append(it)
            self.queues[kind] = keep
        return out

    def _why_waiting(self, kind: Kind, it: Item) -> str:
        if not self.workers:
            return "no node is connected to this queue server"
        if kind == Kind.WRITE and not any(w.is_leader for w in self.workers.values()):
            return "no leader: no majority of nodes is reachable"
        if kind == Kind.READ and not any(w.applied >= it.fence for w in self.workers.values()):
            return f"no node has applied index {it.fence} yet"
        return "all nodes are busy"

    # ------------------------------------------------------------ workers

    def connect(self, worker_id: int, node_id: int) -> None:
        self.workers[worker_id] = Worker(worker_id, node_id)

    def update(self, worker_id: int, is_leader: bool, term: int, applied: int) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.is_leader, w.term, w.applied = is_leader, term, max(applied, 0)

    def grant(self, worker_id: int, writes: int, reads: int) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.write_credit = min(w.write_credit + max(writes, 0), 1 << 20)
            w.read_credit = min(w.read_credit + max(reads, 0), 1 << 20)

    def disconnect(self, worker_id: int) -> list[Item]:
        """The worker is gone: what it held goes back to the front, in order."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        back = sorted(w.inflight.values(), key=lambda it: it.id)
        for it in reversed(back):
            self.queues[it.kind].appendleft(it)
        return back

    def complete(self, worker_id: int, item_id: int) -> Item | None:
        w = self.workers.get(worker_id)
        if w is None:
            return None
        return w.inflight.pop(item_id, None)

    def retry(self, worker_id: int, item_id: int) -> Item | None:
        """The worker could not do it (not the leader any more, say): queue
        it again at the front for another worker."""
        it = self.complete(worker_id, item_id)
        if it is not None:
            it.attempts += 1
            self.queues[it.kind].appendleft(it)
        return it

    # ----------------------------------------------------------- dispatch

    def leader(self) -> Worker | None:
        leaders = [w for w in self.workers.values() if w.is_leader]
        return max(leaders, key=lambda w: w.term) if leaders else None

    def dispatch(self, now: float) -> list[tuple[int, Item]]:
        """Hand out what can go now: (worker id, item) pairs."""
        out: list[tuple[int, Item]] = []
        wq = self.queues[Kind.WRITE]
        lead = self.leader()
        while wq and lead is not None and lead.write_credit > 0:
            it = wq.popleft()
            if it.deadline <= now:
                wq.appendleft(it)  # expire() reports it
                break
            lead.write_credit -= 1
            lead.taken_writes += 1
            lead.inflight[it.id] = it
            out.append((lead.id, it))
        rq = self.queues[Kind.READ]
        waiting: deque[Item] = deque()
        while rq:
            it = rq.popleft()
            w = self._reader_for(it)
            if w is None:
                waiting.append(it)
                continue
            w.read_credit -= 1
            w.taken_reads += 1
            w.inflight[it.id] = it
            out.append((w.id, it))
        self.queues[Kind.READ] = waiting
        return out

    def _reader_for(self, it: Item) -> Worker | None:
        """The eligible worker with the most read credit left (the idlest)."""
        best: Worker | None = None
        ws = list(self.workers.values())
        if not ws:
            return None
        self._rr = (self._rr + 1) % len(ws)
        for w in ws[self._rr :] + ws[: self._rr]:
            if (
                w.read_credit > 0
                and w.applied >= it.fence
                and (best is None or w.read_credit > best.read_credit)
            ):
                best = w
        return best

    def depth(self, kind: Kind) -> int:
        return len(self.queues[kind])
