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

from node_daemon.raft.core import RaftCore
from node_daemon.raft.types import Role


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
