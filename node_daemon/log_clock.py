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
stamp. The monotonic clock runs on across a restart of the process (not of
the host), so the node keeps its last measure in ``data_dir/log-clock``
(``ANCHOR_FILE``: the host's boot id, a monotonic time, a stamp; written
at most every ``SAVE_EVERY_S``, not synced) and takes it up again when it
starts on the same boot: a leader killed while its clock was stepped does
not believe the step when it comes back. After a reboot, or with no such
file, until it has learned a new stamp a node has no monotonic measure of
the time since the stamps on its disk (the whole cluster was down, say):
its first stamp as a leader is then its wall clock (never below the log's
clock), as before this bound existed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from node_daemon.boot import boot_id

# How much faster than time passes the stamps may catch up with a wall clock
# ahead of them (1.0: at most one extra millisecond per millisecond).
CATCH_UP = 1.0
ANCHOR_FILE = "log-clock"  # in the data directory
SAVE_EVERY_S = 1.0


class LogClock:
    """Stamps for a leader's entries (see the module docstring)."""

    def __init__(
        self,
        log_ms: int,
        anchor_file: Path | None = None,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        boot: Callable[[], str] = boot_id,
    ) -> None:
        self._wall = wall
        self._monotonic = monotonic
        self._last = log_ms  # the last stamp taken or learned, in ms: the floor
        # A stamp and when it was taken or learned, on the monotonic clock:
        # the measure stamps are bounded by (None: none yet).
        self._anchor_ms = log_ms
        self._at: float | None = None
        self._file = anchor_file
        self._boot = boot()
        self._saved: tuple[int, float] | None = None
        self._saved_at = float("-inf")
        if anchor_file is not None and self._boot:
            self._load(anchor_file)

    @property
    def last_ms(self) -> int:
        return self._last

    def learn(self, log_ms: int) -> None:
        """The log's clock is ``log_ms`` now (entries were applied)."""
        if log_ms > self._last:
            self._last = self._anchor_ms = log_ms
            self._at = self._monotonic()

    def stamp(self) -> int:
        """The stamp for entries proposed now; never below the last one."""
        now = self._monotonic()
        wall_ms = int(self._wall() * 1000)
        if self._at is None:
            stamp = max(wall_ms, self._last)
        else:
            ceiling = self._anchor_ms + int((now - self._at) * 1000 * (1 + CATCH_UP))
            stamp = max(self._last, min(wall_ms, ceiling))
        if stamp > self._last or self._at is None:
            self._last = self._anchor_ms = stamp
            self._at = now
        return stamp

    def save(self) -> None:
        """Keep the measure for a restart on this boot (at most every
        ``SAVE_EVERY_S``; a lost or torn write only loses the measure)."""
        now = self._monotonic()
        if self._file is None or not self._boot or self._at is None:
            return
        if now - self._saved_at < SAVE_EVERY_S or self._saved == (self._anchor_ms, self._at):
            return
        self._saved_at, self._saved = now, (self._anchor_ms, self._at)
        with contextlib.suppress(OSError):
            self._file.write_text(f"{self._boot} {self._at!r} {self._anchor_ms}\n")

    def _load(self, path: Path) -> None:
        try:
            boot, at, ms = path.read_text().split()
            anchor_at, anchor_ms = float(at), int(ms)
        except (OSError, ValueError):
            return
        if boot == self._boot and anchor_at <= self._monotonic():
            self._anchor_ms, self._at = anchor_ms, anchor_at
