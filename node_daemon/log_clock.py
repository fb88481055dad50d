"""The time a leader stamps into its entries (``Command.leader_ms``).

Everything replicated that needs "now" takes it from those stamps: the
log's clock (the state machine's ``log_ms``, the highest stamp applied)
stamps appends and contributions and is what give-to-get measures against;
group joins and commits, topic creation and retention (a trim's stamp is
its "now") use the stamp of their entry. A leader reads its wall clock for
them, but a wall clock can be stepped. Stepped ahead, and believed, a stamp
hours in the future ages every earlier contribution by as much (issue 21,
nemesis finding 4) and brings retention as much closer; stepped back, it
would make the log's time go back.

So a stamp is the wall clock bounded by what the monotonic clock (which no
step moves) has seen pass since the last stamp this node took or learned:

- never below the last stamp: while the wall clock is behind, stamps stand
  still (as the log's clock always did: it never goes back);
- never above the last stamp plus the monotonic time since, times
  ``1 + CATCH_UP``: a step ahead is not believed; the stamps catch up with
  a wall clock ahead of them (one that was stepped, or one that was right
  while the stamps fell behind) at most as fast as time passes, so that
  anything stamped in the last ``W`` of real time looks at most ``2 W`` old.

A node learns the log's clock as it applies entries (``learn``), with the
monotonic time it learned it at, so the next leader goes on from the last
stamp. After a start, until it has learned a new stamp, a node has no
monotonic measure of the time since the stamps on its disk (the whole
cluster was down, say): its first stamp as a leader is then its wall clock
(never below the log's clock), as before this bound existed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# How much faster than time passes the stamps may catch up with a wall clock
# ahead of them (1.0: at most one extra millisecond per millisecond).
CATCH_UP = 1.0


class LogClock:
    """Stamps for a leader's entries (see the module docstring)."""

    def __init__(
        self,
        log_ms: int,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._wall = wall
        self._monotonic = monotonic
        self._last = log_ms  # the last stamp taken or learned, in ms
        self._at: float | None = None  # when, on the monotonic clock; None: not measured

    @property
    def last_ms(self) -> int:
        return self._last

    def learn(self, log_ms: int) -> None:
        """The log's clock is ``log_ms`` now (entries were applied)."""
        if log_ms > self._last:
            self._last, self._at = log_ms, self._monotonic()

    def stamp(self) -> int:
        """The stamp for entries proposed now; never below the last one."""
        now = self._monotonic()
        wall_ms = int(self._wall() * 1000)
        if self._at is None:
            stamp = max(wall_ms, self._last)
        else:
            ceiling = self._last + int((now - self._at) * 1000 * (1 + CATCH_UP))
            stamp = min(max(wall_ms, self._last), ceiling)
        if stamp > self._last or self._at is None:
            self._last, self._at = stamp, now
        return stamp
