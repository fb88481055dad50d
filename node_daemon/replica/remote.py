"""A Raft group of this node as another group reads it (docs/multiraft.md).

Groups of one node read each other: group 0's handlers serve fetches, topic
offsets and give-to-get from the data groups' replicas, and a data group's
leader checks producer ids and follows topics and membership in group 0's.
``ReplicaView`` is what they read; a ``Replica`` in the same process is one,
and so is a ``RemoteReplica``: a group that another process of this node
runs (worker processes, step 5), read through a read-only view of its
state (``StateReplicaView``) and the live figures (``GroupFigures``: commit
index, configuration, role, term...) that process last told.

Invariants: a ``RemoteReplica`` never writes; its state is never older than
one it showed before; its figures are the last told, so a reader that
needs an index waits for the state to apply it (``wait_applied``), never
for the figures alone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from node_daemon.raft import ConfState
from node_daemon.state.machine import StateMachine
from node_daemon.state.replica_view import StateReplicaView
from roadlog.errors import Code, RoadlogError

if TYPE_CHECKING:  # status.py reads ReplicaView from here
    from node_daemon.replica.status import GroupFigures


class ReplicaView(Protocol):
    """What one group of a node reads of another."""

    group: int

    @property
    def sm(self) -> StateMachine: ...

    @property
    def is_leader(self) -> bool: ...

    def committed_index(self) -> int: ...

    def conf_state(self) -> ConfState: ...

    async def wait_applied(self, index: int, timeout: float | None = None) -> None: ...

    async def read_barrier(self) -> int: ...


WAIT_FOREVER_S = 3600.0  # a wait without a timeout, bounded all the same


class RemoteReplica:
    """Group ``group``, run by another process of this node; ``state_dir``
    is its state's directory (``groups/<g>/state``, or ``state`` for 0)."""

    def __init__(self, group: int, state_dir: Path) -> None:
        self.group = group
        self.view = StateReplicaView(state_dir, group)
        self.committed = 0
        self.conf = ConfState()
        self.leader = False
        self.figures: GroupFigures | None = None  # as last told (None: not yet)
        # Asks the group's process for a ReadIndex (set by its supervisor).
        self.ask_barrier: Callable[[], Awaitable[int]] | None = None

    @property
    def sm(self) -> StateMachine:
        """The state as it is now (UNAVAILABLE while not there or rebuilding)."""
        return self.view.current()

    @property
    def is_leader(self) -> bool:
        return self.leader

    def committed_index(self) -> int:
        return self.committed

    def conf_state(self) -> ConfState:
        return self.conf

    async def wait_applied(self, index: int, timeout: float | None = None) -> None:
        """Until the state applied ``index``; TimeoutError after ``timeout``
        (as ``Replica.wait_applied``)."""
        try:
            await self.view.wait_applied(index, WAIT_FOREVER_S if timeout is None else timeout)
        except RoadlogError as e:
            raise TimeoutError(e.message) from None

    async def read_barrier(self) -> int:
        """A linearizable read point of the group (ReadIndex, taken by the
        process that runs it), once this view applied it."""
        if self.ask_barrier is None:
            raise RoadlogError(Code.UNAVAILABLE, f"group {self.group}'s process cannot be asked")
        index = await self.ask_barrier()
        await self.view.wait_applied(index, WAIT_FOREVER_S)
        return index

    def told(self, figures: GroupFigures) -> None:
        """Its figures, as its process told them (a worker's group, read by
        the main process)."""
        self.figures = figures
        self.told_conf(figures.commit_index, figures.voters, figures.learners)
        self.leader = figures.is_leader

    def told_conf(self, committed: int, voters: Iterable[int], learners: Iterable[int]) -> None:
        """Its commit index and configuration alone (group 0, read by a
        worker, which never leads it: ``is_leader`` stays False)."""
        self.committed = max(self.committed, committed)
        self.conf = ConfState(frozenset(voters), frozenset(learners))
