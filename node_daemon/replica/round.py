"""The round: one Ready pass per turn of the event loop over every group of
the process that has work (issue 42; TiKV raftstore's batch system: poll
every ready region, then persist once, send once, apply).

A ``Replica`` run in a round has no driver task of its own: whatever wakes
it (a message, a proposal, a tick, a write or an apply done) marks it woken
here, and the round's pass, once per turn, runs each woken group's turn
(``Replica.round_turn``: step the core with its inbox, pump its
``ReadyDriver``) and then, once for all of them:

1. the transport's flush: one frame per peer carrying every group's
   messages of the pass (the leaders' appends that may go early, and what
   the previous pass's durable writes let go);
2. the group commit's flush (``GroupCommit.flush_now``): one transaction and
   one fsync for every group's log write of the pass, on the loop when each
   may be written there, else on the store's thread;
3. the small applies the groups deferred (``defer``) until their frames
   left, so a follower's append response never waits on an apply.

Groups that a flush or an apply finished are woken and the pass goes on
(at most ``MAX_PASSES`` times in one turn; the rest in the next).

Invariants:
- Persist before send is the driver's (``raft.driver``, invariant 2): a
  message that promises durability is handed to the transport only after
  its group's write is reported done, and a write is reported done only
  after its commit's fsync; a round only decides when queued frames and
  writes go, never what may go.
- Each group is turned at most once per pass, and a group the round was
  told has failed (its turn raised) is never turned again: its
  ``on_failure`` is told, as its own driver task's failure was.
- A completion that arrives between turns (a flush or an apply done on a
  thread) runs the pass at once (``run_now``), as the driver used to be
  pumped at once: its acks leave in that turn, not a turn later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from node_daemon.storage.group_commit import GroupCommit
from node_daemon.transport.peer_transport import PeerTransport

log = logging.getLogger("roadlog.node")

MAX_PASSES = 8  # passes in one turn of the loop before the loop's other work


class Turned(Protocol):
    """What a round drives: one group's replica."""

    group: int

    def round_turn(self) -> None: ...


class Round:
    """One process's round over its groups (see the module docstring)."""

    def __init__(self, transport: PeerTransport, commits: GroupCommit | None) -> None:
        self.transport = transport
        self.commits = commits
        self._members: dict[int, tuple[Turned, Callable[[BaseException], None] | None]] = {}
        self._woken: dict[int, Turned] = {}  # by group, in the order woken
        self._deferred: list[Callable[[], None]] = []
        self._running = False
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.passes = 0  # ever (tests and figures)
        self.turns = 0  # groups turned, ever
        if commits is not None:
            commits.on_reported = self.run_now

    def add(self, member: Turned, on_failure: Callable[[BaseException], None] | None) -> None:
        """Drive ``member`` from now on (woken once, to do what it has)."""
        self._loop = asyncio.get_running_loop()
        self._members[member.group] = (member, on_failure)
        self.wake(member)

    def remove(self, member: Turned) -> None:
        """Drive ``member`` no more (stopped, or failed)."""
        self._members.pop(member.group, None)
        self._woken.pop(member.group, None)

    def wake(self, member: Turned) -> None:
        """``member`` has work: turn it in this turn's pass (or the next)."""
        if member.group not in self._members:
            return
        self._woken[member.group] = member
        if not self._running and not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._scheduled_run)

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in this pass once the transport's frames have left."""
        self._deferred.append(fn)

    def _scheduled_run(self) -> None:
        self._scheduled = False
        self.run_now()

    def run_now(self) -> None:
        """Run the pass now, unless one is running (it picks up what was woken)."""
        if self._running:
            return
        self._running = True
        try:
            for _ in range(MAX_PASSES):
                if not self._woken and not self._deferred:
                    break
                self._pass()
        finally:
            self._running = False
        if (self._woken or self._deferred) and not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._scheduled_run)

    def _pass(self) -> None:
        self.passes += 1
        woken, self._woken = self._woken, {}
        for g, member in woken.items():
            entry = self._members.get(g)
            if entry is None:
                continue
            self.turns += 1
            try:
                member.round_turn()
            except Exception as e:
                self._failed(member, e)
        self.transport.flush()  # one frame per peer for every group's messages
        if self.commits is not None:
            self.commits.flush_now()  # one transaction, one fsync
        deferred, self._deferred = self._deferred, []
        for fn in deferred:
            fn()

    def _failed(self, member: Turned, e: BaseException) -> None:
        entry = self._members.get(member.group)
        self.remove(member)
        log.critical("the Raft driver failed", exc_info=e, extra={"group": member.group})
        if entry is not None and entry[1] is not None:
            entry[1](e)
