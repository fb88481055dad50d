"""When a Raft core's next tick can do more than count (lazy ticks).

A core's ``tick()`` only counts (election and heartbeat elapsed, its
leader and quiet ticks) except at a few ticks: a leader's heartbeat, its
check-quorum (and a leader transfer's timeout) at the election timeout, a
lazy commit still untold; a promotable follower's (or candidate's)
randomized election timeout. ``ticks_until_action`` says how many ticks
from now the first of those is, read from the core's state (nothing of the
core is changed: ``node_daemon/raft/core.py``'s algorithm is its own).

Invariant: ticking the core ``ticks_until_action(core) - 1`` times, with no
other input between, changes nothing but its counters (no message, no role
or term change); so a ticker may sleep until that tick, and hand the core
the ticks it slept through, in order, before anything else reaches it
(``Replica``'s lazy ticks). A core that never acts on a tick (a learner, a
voter removed) is given ``election_tick``: its counters, which status reads,
stay within one election timeout of the eager count.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from node_daemon.raft.core import RaftCore
from node_daemon.raft.types import Role


def tick_n(core: RaftCore, n: int) -> None:
    for _ in range(n):
        core.tick()


class LazyTicks:
    """A replica's lazy ticks (``start(own_ticker=False, lazy_ticks=True)``,
    the Store's ticker), on the grid of ``tick_s`` from their start.

    Invariant: the core gets the same ticks, in the same order with
    everything else it is given, as from a ticker that ticks every
    ``tick_s``: every input (``Replica.submit``, a proposal) first queues
    the ticks ``owed`` up to its arrival; the ticker itself wakes only at
    ``due_at``, the first tick at which the core may act
    (``ticks_until_action``), instead of every tick. An idle follower is
    woken by its election timeout (or the Store's LAZY_CHORES_S), not 50
    times a second; a leader by its heartbeats."""

    def __init__(self, tick_s: float) -> None:
        self.tick_s = tick_s
        self.on = False
        self.next_at = 0.0  # the next tick boundary not yet handed to the core
        self.due_at = 0.0  # the boundary of the first tick that may act
        self.on_due: Callable[[float], None] | None = None  # told each new due_at

    def start(self, now: float) -> None:
        self.on = True
        self.next_at = self.due_at = now + self.tick_s

    def owed(self, now: float) -> int:
        """The ticks for every boundary that passed by ``now`` (0: none), now
        counted as handed over; ``due_at`` is unknown until ``moved``."""
        if now < self.next_at:
            return 0
        n = int((now - self.next_at) // self.tick_s) + 1
        self.next_at += n * self.tick_s
        self.due_at = math.inf  # until the driver has run them
        return n

    def moved(self, core: RaftCore) -> None:
        """After the driver ran: when the core's first tick that may act is."""
        due = self.next_at + (ticks_until_action(core) - 1) * self.tick_s
        if due != self.due_at:
            self.due_at = due
            if self.on_due is not None:
                self.on_due(due)


def ticks_until_action(core: RaftCore) -> int:
    """How many ticks from now (1: the next) until the first at which
    ``core.tick()`` may act."""
    cfg = core.cfg
    if core.role == Role.LEADER:
        told = core._tick_committed  # the commit index a tick tells lazily
        if cfg.lazy_commit and (
            told != core.log.committed
            or any(n != core.id and pr.commit_sent < told for n, pr in core.prs.items())
        ):
            return 1
        return max(
            1,
            min(
                cfg.heartbeat_tick - core.heartbeat_elapsed,
                cfg.election_tick - core.election_elapsed,
            ),
        )
    if core.promotable():
        return max(1, core.randomized_election_timeout - core.election_elapsed)
    return max(1, cfg.election_tick)
