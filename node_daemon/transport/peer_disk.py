"""What a process knows of its peers' disks: the "disk low" bit each peer
sets on every batch it sends (``RaftBatch.disk_low``).

A node whose disk is low (``node_daemon.storage.disk.DiskGuard.low``)
refuses growing writes. Its peers must know, so that no leader hands it a
group and so that it, as leader, hands its groups to a peer with room
(``node_daemon.store.leader_balance``). The bit rides on what the peers
already send each other: every batch of Raft messages, heartbeats and
their responses included, says whether its sender's disk is low. Nothing
is sent for it alone, and nothing of it is in the Raft messages or the
Raft core.

Invariants:
- Per node, not per group or per message: the latest batch from a node
  (of any of its groups, from any of its processes) tells its disk state,
  with the time it came (this process's monotonic clock).
- News goes stale: ``low`` answers None (unknown) for a node not heard
  from within ``stale_s``. The deciders treat unknown as not low (see
  ``leader_balance``): a node is only a leader's candidate once it is
  heard from lately anyway (Raft's ``recent_active``, well within
  ``stale_s``), and every batch it sent meanwhile carried its bit; a node
  of an older version never sets the bit, and is taken at its word.
- Sans-I/O: ``heard`` and ``low`` take the time; the transport calls
  ``heard`` for each batch it accepts, the balancer reads ``low``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

STALE_S = 5.0  # at least; a node's news older than this says nothing


def stale_after(tick_ms: int, heartbeat_ticks: int, election_ticks: int) -> float:
    """How long a peer's disk news holds: STALE_S, or several heartbeat and
    election intervals where those are longer (a slow-ticking cluster)."""
    heartbeat_s = tick_ms * heartbeat_ticks / 1000
    election_s = tick_ms * election_ticks / 1000
    return max(STALE_S, 4 * heartbeat_s, 2 * election_s)


@dataclass
class PeerDisks:
    """Each peer's disk state as its latest batch said."""

    stale_s: float = STALE_S
    _news: dict[int, tuple[bool, float]] = field(default_factory=dict)  # node -> (low, when)

    def heard(self, node: int, low: bool, now: float) -> None:
        """A batch from ``node`` came at ``now``, saying its disk is ``low``."""
        self._news[node] = (low, now)

    def low(self, node: int, now: float) -> bool | None:
        """Whether ``node``'s disk is low: True or False as its latest batch
        said, if that came within ``stale_s``; None (unknown) otherwise."""
        news = self._news.get(node)
        if news is None or now - news[1] > self.stale_s:
            return None
        return news[0]

    def known_low(self, nodes: Iterable[int], now: float) -> frozenset[int]:
        """Those of ``nodes`` whose disk is known to be low now."""
        return frozenset(n for n in nodes if self.low(n, now) is True)

    def known_not_low(self, nodes: Iterable[int], now: float) -> frozenset[int]:
        """Those of ``nodes`` that said lately their disk is not low."""
        return frozenset(n for n in nodes if self.low(n, now) is False)
