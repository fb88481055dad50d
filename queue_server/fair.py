"""A bounded queue that is fair between clients (sans-I/O).

Each client has its own FIFO; ``pop`` takes from the clients in turn, so a
client that floods the queue waits behind its own requests, not in front of
everyone else's. Items handed back (their node died, or lost leadership) go
to a front lane that is served before anyone's FIFO, in their first order.

Invariants: ``len`` counts every item held; ``push`` never lets the total
exceed ``max_total`` nor one client's share exceed ``max_per_client``;
items of one client come out in the order they went in.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar


class HasClient(Protocol):
    @property
    def client(self) -> str: ...


T = TypeVar("T", bound=HasClient)


class Full(Exception):
    """The queue, or this client's share of it, is full."""


class FairQueue(Generic[T]):
    def __init__(self, max_total: int, max_per_client: int) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self._front: deque[T] = deque()
        self._lanes: OrderedDict[str, deque[T]] = OrderedDict()  # rotation order
        self._len = 0

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
        if lane is None:
            lane = self._lanes[item.client] = deque()
        lane.append(item)
        self._len += 1

    def push_front(self, items: list[T]) -> None:
        """Hand items back to be served first, in the given order (no bound:
        they were admitted before)."""
        self._front.extendleft(reversed(items))
        self._len += len(items)

    def pop(self) -> T | None:
        if self._front:
            self._len -= 1
            return self._front.popleft()
        while self._lanes:
            client, lane = next(iter(self._lanes.items()))
            if not lane:
                del self._lanes[client]
                continue
            item = lane.popleft()
            self._len -= 1
            if lane:
                self._lanes.move_to_end(client)  # the next client's turn
            else:
                del self._lanes[client]
            return item
        return None

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
                else:
                    del self._lanes[client]
        self._len -= len(out)
        return out
