"""What anyone who reaches a framed port may hold there: the limits of the
server end of every framed link (the publish link, the Work link, the peer
link), and the guard that keeps them.

A ``LinkGuard`` per listening port admits each connection before its TLS
handshake (caps in total and per source address, for connections not yet
past their hello, "strangers", and for all), owns the ``FrameBudget`` that
every connection's partial frames draw on, and sweeps its connections once a
second: a link that sent nothing for ``idle_s``, or whose frame, once begun,
is not whole within ``frame_s`` plus its length at ``min_rate`` bytes a
second, is cut.

Invariants:
- A connection over a cap is closed as it is accepted: it costs a socket
  for a moment, no TLS state and no buffer.
- Strangers hold no budget: before its hello a connection reads only into
  its own buffer of a few KiB (the hello's limit), so strangers together
  hold at most ``max_strangers`` times that (and the TLS state of as many
  handshakes).
- The frames being read on all connections together claim at most
  ``buffer_bytes``: a big frame begins only once the budget grants its
  whole length (a connection whose frame does not fit stops reading until
  others give bytes back, first come first served), so what they hold is
  less still.
- A buffer grows as bytes arrive (to at most ``GROWTH`` times what came),
  never from a frame header's claim alone.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

SWEEP_S = 1.0  # how often a guard looks at its connections' clocks


@dataclass(frozen=True)
class LinkLimits:
    """One port's limits (each kind of link has its own defaults)."""

    max_links: int = 1024  # connections at once
    max_links_per_source: int = 64  # from one address
    max_strangers: int = 128  # connections not yet past their hello
    max_strangers_per_source: int = 16
    handshake_s: float = 5.0  # TLS and the hello, from the accept
    idle_s: float = 300.0  # nothing received for this long: cut (0: never)
    frame_s: float = 10.0  # a frame begun is whole within this ...
    min_rate: int = 64 << 10  # ... plus its length at this many bytes a second
    buffer_bytes: int = 256 << 20  # partial frames of every connection together

    def __post_init__(self) -> None:
        if min(self.max_links, self.max_links_per_source, self.max_strangers) < 1:
            raise ValueError("link limits: every connection cap must be at least 1")
        if self.max_strangers_per_source < 1 or self.buffer_bytes < 1 << 20:
            raise ValueError("link limits: a stranger per source, and a budget of 1 MiB at least")
        if self.handshake_s <= 0 or self.frame_s <= 0 or self.min_rate <= 0 or self.idle_s < 0:
            raise ValueError("link limits: deadlines and the rate must be positive")

    def frame_deadline_s(self, length: int) -> float:
        """How long a frame of ``length`` bytes may take once begun."""
        return self.frame_s + length / self.min_rate


class FrameBudget:
    """Bytes that frames being read may claim, shared by one port's
    connections. ``take`` never lets ``used`` pass ``total``; ``force``
    does (only for a loop that reads past a pause); ``give`` hands bytes
    back and wakes the connections waiting for them, first come first
    served: one that still does not fit keeps its place, and those behind
    it wait (a big frame is not starved by small ones)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.peak = 0
        self._waiting: deque[Callable[[], bool]] = deque()
        self._granting = False  # the first in line is being asked

    def take(self, n: int) -> bool:
        """``n`` bytes, if they fit and nobody waits before the asker."""
        if self.used + n > self.total or (self._waiting and not self._granting):
            return False
        self.force(n)
        return True

    def force(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def give(self, n: int) -> None:
        self.used -= n
        while self._waiting and self.used < self.total and not self._granting:
            self._granting = True
            try:
                granted = self._waiting[0]()
            finally:
                self._granting = False
            if not granted:
                break  # it still does not fit: it keeps its place, the rest wait too
            self._waiting.popleft()

    def wait(self, retry: Callable[[], bool]) -> None:
        """Call ``retry`` as bytes come back until it returns True (it got
        what it needed, or needs nothing any more)."""
        self._waiting.append(retry)

    @property
    def waiting(self) -> int:
        return len(self._waiting)


def source_key(host: str) -> str:
    """The address a cap counts a connection under: the host as it came
    (an IPv4-mapped IPv6 address as its IPv4 one)."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


class Guarded(Protocol):
    """What a guard needs of a connection."""

    source: str
    authenticated: bool

    def clocks(self) -> tuple[int, int, int]:
        """(bytes received, frames received, length of the frame begun or 0)."""
        ...

    @property
    def paused_by_us(self) -> bool:
        """Not reading because this end chose so (backpressure): no clock runs."""
        ...

    def refuse(self, why: str) -> None: ...

    def close_idle(self, why: str) -> None: ...


@dataclass(slots=True)
class _Clock:
    """A connection's clocks at the sweep that last saw it change."""

    opened: float
    at: float  # since when it is in the state the fields below describe
    received: int
    frames: int
    mid_frame: bool


class LinkGuard:
    """Keeps one port's ``LinkLimits`` over its connections (module doc).
    ``on_cut(why)`` hears of every connection refused at accept or cut by
    a clock (for a metric; ``why`` is one of a few fixed words)."""

    def __init__(self, limits: LinkLimits, on_cut: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self.budget = FrameBudget(limits.buffer_bytes)
        self.on_cut = on_cut or (lambda why: None)
        self._links: dict[Guarded, _Clock] = {}
        self._per_source: dict[str, int] = {}
        self._strangers: dict[str, int] = {}
        self._stranger_count = 0
        self._sweeper: asyncio.TimerHandle | None = None
        self.refused = 0

    @property
    def links(self) -> int:
        return len(self._links)

    @property
    def strangers(self) -> int:
        return self._stranger_count

    def admit(self, conn: Guarded) -> str:
        """Count a new connection in; the reason it may not stay ("" if it may)."""
        lim, src = self.limits, conn.source
        if len(self._links) >= lim.max_links:
            why = "links"
        elif self._per_source.get(src, 0) >= lim.max_links_per_source:
            why = "links_per_source"
        elif self._stranger_count >= lim.max_strangers:
            why = "strangers"
        elif self._strangers.get(src, 0) >= lim.max_strangers_per_source:
            why = "strangers_per_source"
        else:
            loop = asyncio.get_running_loop()
            now = loop.time()
            self._links[conn] = _Clock(now, now, 0, 0, False)
            self._per_source[src] = self._per_source.get(src, 0) + 1
            self._strangers[src] = self._strangers.get(src, 0) + 1
            self._stranger_count += 1
            if self._sweeper is None:
                self._sweeper = loop.call_later(SWEEP_S, self._sweep)
            return ""
        self.refused += 1
        self.on_cut(why)
        return why

    def known(self, conn: Guarded) -> None:
        """``conn`` is past its hello: no longer a stranger."""
        if conn in self._links and not conn.authenticated:
            conn.authenticated = True
            self._uncount_stranger(conn.source)

    def gone(self, conn: Guarded) -> None:
        """``conn`` closed (any number of calls)."""
        if self._links.pop(conn, None) is None:
            return
        src = conn.source
        left = self._per_source[src] - 1
        if left:
            self._per_source[src] = left
        else:
            del self._per_source[src]
        if not conn.authenticated:
            self._uncount_stranger(src)
        if not self._links and self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _uncount_stranger(self, src: str) -> None:
        self._stranger_count -= 1
        left = self._strangers[src] - 1
        if left:
            self._strangers[src] = left
        else:
            del self._strangers[src]

    def _sweep(self) -> None:
        """Cut the links whose clocks ran out; runs every SWEEP_S while any is open.

        A clock restarts whenever a connection's state changes between two
        sweeps (a frame completed, one begun, bytes after idling) or this
        end holds it paused, so a frame's time counts from the sweep that
        first saw it begun (at most SWEEP_S late) and idling from the
        sweep after its last byte."""
        loop = asyncio.get_running_loop()
        now, lim = loop.time(), self.limits
        late: list[tuple[Guarded, str]] = []
        for conn, clock in self._links.items():
            received, frames, pending = conn.clocks()
            if not conn.authenticated and now - clock.opened >= lim.handshake_s:
                late.append((conn, "handshake"))
            elif (
                conn.paused_by_us
                or frames != clock.frames
                or (pending > 0) != clock.mid_frame
                or (not pending and received != clock.received)
            ):
                clock.at, clock.received, clock.frames = now, received, frames
                clock.mid_frame = pending > 0
            elif pending:
                if now - clock.at >= lim.frame_deadline_s(pending):
                    late.append((conn, "frame_deadline"))
            elif lim.idle_s and now - clock.at >= lim.idle_s:
                late.append((conn, "idle"))
        for conn, why in late:
            self.on_cut(why)
            if why == "idle":
                conn.close_idle(f"nothing received for {lim.idle_s:g} s")
            elif why == "handshake":
                conn.refuse("no hello in time")
            else:
                conn.refuse("a frame not whole in time")
            self.gone(conn)
        self._sweeper = loop.call_later(SWEEP_S, self._sweep) if self._links else None
