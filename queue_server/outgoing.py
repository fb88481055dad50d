"""A work item on its way to a node, as the wire bytes of a WorkItems
element (the client's request never copied)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from queue_server.queues import Item
from roadlog.protowire import length_delimited
from roadlog.rpc import Kind
from roadlog.v1 import work_pb2

_ITEMS_ITEMS = work_pb2.WorkItems.ITEMS_FIELD_NUMBER
_ITEMS_FENCE_WAIT = work_pb2.WorkItems.FENCE_WAIT_FIELD_NUMBER
_ITEM_REQUEST = work_pb2.WorkItem.REQUEST_FIELD_NUMBER
_KIND = {Kind.WRITE: work_pb2.WORK_KIND_WRITE, Kind.READ: work_pb2.WORK_KIND_READ}


@dataclass(slots=True, eq=False)
class Outgoing:
    """A work item on its way to a node: its WorkItem's wire bytes but the
    request (``head``: every other field, then the request's tag and
    length) and the request as the client sent it, never copied."""

    id: int
    head: bytes
    request: bytes

    @classmethod
    def of(cls, it: Item, now: float) -> Outgoing:
        """``it`` handed out at ``now`` (monotonic): its deadline goes as
        the wall-clock time and as the milliseconds left (``budget_ms``)."""
        left = max(it.deadline - now, 0.001)
        head = work_pb2.WorkItem(
            id=it.id,
            kind=_KIND[it.kind],
            method=it.method,
            fence=it.fence,
            deadline_unix_ms=int((time.time() + left) * 1000),
            principal=it.principal,
            scopes=it.scopes,
            registered=it.registered,
            group=it.group,
            budget_ms=min(int(left * 1000) or 1, (1 << 32) - 1),
        ).SerializeToString()
        return cls(it.id, head + length_delimited(_ITEM_REQUEST, len(it.request)), it.request)

    def parts(self) -> list[bytes]:
        """This item as an element of WorkItems.items."""
        size = len(self.head) + len(self.request)
        return [length_delimited(_ITEMS_ITEMS, size), self.head, self.request]
