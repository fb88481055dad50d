"""A bounded queue that is fair between clients (sans-I/O).

Each client has its own FIFO; ``pop`` takes from the clients in turn, so a
client that floods the queue waits behind its own requests, not in front of
everyone else's. Items handed back (their node died, or lost leadership) go
to a front lane that is served before anyone's FIFO, in their first order.

Invariants: ``len`` counts every item held and ``bytes`` their sizes;
``push`` never lets the total exceed ``max_total`` items or ``max_bytes``,
nor one client's share exceed ``max_per_client`` items or
``max_client_bytes``; items of one client come out in the order they went
in.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar


class HasClient(Protocol):
    @property
    def client(self) -> str: ...

    @property
    def size(self) -> int: ...


T = TypeVar("T", bound=HasClient)


class Full(Exception):
    """The queue, or this client's share of it, is full."""


class FairQueue(Generic[T]):
    def __init__(
        self,
        max_total: int,
        max_per_client: int,
        max_bytes: int = 1 << 62,
        max_client_bytes: int = 1 << 62,
    ) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.max_bytes = max_bytes
        self.max_client_bytes = max_client_bytes
        self._front: deque[T] = deque()
        self._lanes: OrderedDict[str, deque[T]] = OrderedDict()  # rotation order
        self._lane_bytes: dict[str, int] = {}
        self._len = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[T]:
        yield from self._front
        for lane in self._lanes.values():
            yield from lane

    def clients(self) -> int:
        return len(self._lanes)

    def push(self, item: T) -> None:
        if self._len >= self.max_total:
            raise Full(f"queue is full ({self._len} waiting)")
        lane = self._lanes.get(item.client)
        if lane is not None and len(lane) >= self.max_per_client:
            raise Full(
                f"queue: client {item.client!r} has {len(lane)} requests waiting already "
                f"(at most {self.max_per_client} each)"
            )
        if self.bytes + item.size > self.max_bytes:
            raise Full(f"queue is full ({self.bytes} bytes waiting, at most {self.max_bytes})")
        held = self._lane_bytes.get(item.client, 0)
        if held + item.size > self.max_client_bytes:
            raise Full(
                f"queue: client {item.client!r} has {held} bytes waiting already "
                f"(at most {self.max_client_bytes} each)"
            )
        if lane is None:
            lane = self._lanes[item.client] = deque()
        lane.append(item)
        self._lane_bytes[item.client] = held + item.size
        self._len += 1
        self.bytes += item.size

    def push_front(self, items: list[T]) -> None:
        """Hand items back to be served first, in the given order (no bound:
        they were admitted before)."""
        self._front.extendleft(reversed(items))
        self._len += len(items)
        self.bytes += sum(it.size for it in items)

    def pop(self) -> T | None:
        if self._front:
            self._len -= 1
            first = self._front.popleft()
            self.bytes -= first.size
            return first
        while self._lanes:
            client, lane = next(iter(self._lanes.items()))
            if not lane:
                self._drop_lane(client)
                continue
            return self._take_head(client, lane)
        return None

    def take_first(self, eligible: Callable[[T], bool]) -> T | None:
        """Like ``pop``, but only an item ``eligible`` accepts: the first such
        handed-back item, else the head of the next client's lane that is
        (a client whose head must wait keeps its place and its order). What
        is not taken stays where it was, counted against its client."""
        for i, it in enumerate(self._front):
            if eligible(it):
                del self._front[i]
                self._len -= 1
                self.bytes -= it.size
                return it
        for client, lane in list(self._lanes.items()):
            if lane and eligible(lane[0]):
                return self._take_head(client, lane)
        return None

    def _take_head(self, client: str, lane: deque[T]) -> T:
        """Take the head of ``client``'s non-empty lane; the next client's
        turn comes after (an emptied lane is dropped)."""
        item = lane.popleft()
        self._len -= 1
        self.bytes -= item.size
        self._lane_bytes[client] -= item.size
        if lane:
            self._lanes.move_to_end(client)
        else:
            self._drop_lane(client)
        return item

    def _drop_lane(self, client: str) -> None:
        del self._lanes[client]
        self._lane_bytes.pop(client, None)

    def remove_if(self, doomed: Callable[[T], bool]) -> list[T]:
        """Take out (and return, in queue order) every item ``doomed`` picks."""
        out = [it for it in self._front if doomed(it)]
        if out:
            self._front = deque(it for it in self._front if not doomed(it))
        for client in list(self._lanes):
            lane = self._lanes[client]
            gone = [it for it in lane if doomed(it)]
            if gone:
                out += gone
                kept = deque(it for it in lane if not doomed(it))
                if kept:
                    self._lanes[client] = kept
                    self._lane_bytes[client] -= sum(it.size for it in gone)
                else:
                    self._drop_lane(client)
        self._len -= len(out)
        self.bytes -= sum(it.size for it in out)
        return out
