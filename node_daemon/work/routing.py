"""A node's work, routed by Raft group (multi-raft, docs/multiraft.md).

Each group the node runs has its own ``WorkHandler`` (against that group's
``Replica``); a work item goes to the handler of its ``WorkItem.group``.
Group 0, the metadata group, takes topics, consumer groups, clients and heat
maps; data groups take the appends and reads of their partitions. What the
queue server must know of the data groups to route (role, term, indexes)
rides in ``WorkerState.groups`` (``data_group_states``).

A worker process (docs/multiraft.md step 5) runs data groups only: its
handlers have no group 0, and its links say so (``data_groups_only``).

Invariant: an item of a group this process does not run is answered
UNAVAILABLE ("runs no group g"), never done in another group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from node_daemon.replica.status import group_figures
from roadlog.errors import Code
from roadlog.v1 import work_pb2

if TYPE_CHECKING:
    from node_daemon.replica.replica import Replica
    from node_daemon.work.handler import WorkHandler


class Executor(Protocol):
    """What a queue server link hands its work items to."""

    async def run(self, item: work_pb2.WorkItem) -> work_pb2.WorkResult: ...

    def reads_flowing(self, link: object, on: bool) -> None: ...


class WorkRouter:
    """The work handlers of the groups this process runs."""

    def __init__(self, handlers: Mapping[int, WorkHandler]) -> None:
        if not handlers:
            raise ValueError("a process with work runs at least one group")
        self.handlers = dict(handlers)

    @property
    def meta(self) -> WorkHandler:
        """Group 0's handler (consumer groups, topics, clients, heat maps):
        the main process's only."""
        return self.handlers[0]

    async def run(self, item: work_pb2.WorkItem) -> work_pb2.WorkResult:
        handler = self.handlers.get(item.group)
        if handler is None:
            return work_pb2.WorkResult(
                id=item.id,
                code=Code.UNAVAILABLE,
                message=f"this node runs no group {item.group}",
            )
        return await handler.run(item)

    def reads_flowing(self, link: object, on: bool) -> None:
        """Fenced reads come in at ``link`` lately (or no more): every group's
        leader tells its followers each commit at once meanwhile."""
        for handler in self.handlers.values():
            handler.reads_flowing(link, on)


def data_group_states(data: Mapping[int, Replica]) -> list[work_pb2.GroupState]:
    """What the queue server routes a node's data groups by, in group order."""
    out = []
    for g, n in sorted(data.items()):
        f = group_figures(n)
        out.append(
            work_pb2.GroupState(
                group=g,
                is_leader=f.is_leader,
                term=f.term,
                applied_index=f.applied_index,
                commit_index=f.commit_index,
            )
        )
    return out
