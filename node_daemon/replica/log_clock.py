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
not believe the step when it comes back.

After a reboot, or with no such file, until it has learned a new stamp a
node has no monotonic measure of the time since the stamps on its disk.
Such a node may still win an election (every node went down, say, and the
others came back before anything was stamped): its first stamp would be
its wall clock, believed whole, and a step of it a jump of the log's clock
(issue 21, nemesis finding 21: a leader rebooted onto a clock 30 minutes
ahead stamped 30 minutes ahead, and clients that had published a minute
before were refused heat maps). So a granted vote carries the voter's
``reading`` (what it would stamp now, and whether it has a measure), and a
leader without a measure takes up, before its first stamp (``lead``):

- the highest reading of a voter with a measure (each is the log's clock
  at its last stamp plus the real time since, bounded by its wall clock);
- with none, the lowest wall clock among itself and its voters, a
  majority: one clock stepped ahead is not believed unless every clock of
  that majority was.

A reading is never below the log's clock (the floor). With no reading at
all (one voter: a single-node cluster) the leader's wall clock is taken.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from node_daemon.storage.boot import boot_id

# How much faster than time passes the stamps may catch up with a wall clock
# ahead of them (1.0: at most one extra millisecond per millisecond).
CATCH_UP = 1.0
ANCHOR_FILE = "log-clock"  # in the data directory
SAVE_EVERY_S = 1.0


class Reading(NamedTuple):
    """What a node would stamp now, in ms, and whether that is bounded by a
    monotonic measure (``measured``) or is its bare wall clock."""

    ms: int
    measured: bool


_READING = struct.Struct(">cq")
_MEASURED, _WALL = b"M", b"W"


def encode_reading(r: Reading) -> bytes:
    """A reading as a vote's context (9 bytes)."""
    return _READING.pack(_MEASURED if r.measured else _WALL, r.ms)


def decode_reading(data: bytes) -> Reading | None:
    """The reading in a vote's context; None for anything else (an empty
    context: a voter from before readings)."""
    if len(data) != _READING.size:
        return None
    kind, ms = _READING.unpack(data)
    if kind not in (_MEASURED, _WALL):
        return None
    return Reading(ms, kind == _MEASURED)


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

    @property
    def measured(self) -> bool:
        """Whether stamps are bounded by a monotonic measure yet."""
        return self._at is not None

    def reading(self) -> Reading:
        """What this node would stamp now (nothing changes): for a vote."""
        wall_ms = int(self._wall() * 1000)
        if self._at is None:
            return Reading(max(wall_ms, self._last), False)
        ceiling = self._anchor_ms + int((self._monotonic() - self._at) * 1000 * (1 + CATCH_UP))
        return Reading(max(self._last, min(wall_ms, ceiling)), True)

    def lead(self, voters: Iterable[Reading]) -> None:
        """This node now leads with the votes of ``voters``: without a
        measure of its own, take one up from their readings (see the
        module docstring); with one, nothing changes."""
        if self._at is not None:
            return
        readings = list(voters)
        if not readings:
            return  # no voter but itself: its wall clock, at the first stamp
        measured = [r.ms for r in readings if r.measured]
        if measured:
            start = max(measured)
        else:
            start = min(int(self._wall() * 1000), *(r.ms for r in readings))
        self._last = self._anchor_ms = max(self._last, start)
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
