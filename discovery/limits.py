"""Bounds on the work received discovery datagrams may cause (sans-I/O).

A flood of datagrams at the discovery port cost a node about a core (issue
19, finding 16): every one was read, MAC-checked and parsed. Now every
datagram read takes a token from one bucket for all sources (``total``)
first, then one from its source address's bucket, before any MAC or JSON
work; a datagram that gets no token is dropped and counted. When the total
bucket is empty the adapter stops reading the socket until a token is back
(``paused_until``), so what a flood costs beyond the cap is the kernel's
dropping, not ours.

Legitimate traffic is a HELLO per process per second (a node and a queue
server may share an address, and seeds get a unicast copy), plus at most
one answer per member per newcomer and interval: far below the defaults.
Source addresses of UDP can be forged; the total cap holds whatever they
say, and the per-source table is bounded (``max_sources``, oldest out).
"""

from __future__ import annotations

from dataclasses import dataclass

PER_SOURCE_RATE = 20.0  # datagrams per second from one address
PER_SOURCE_BURST = 40.0
TOTAL_RATE = 1000.0  # datagrams per second from everyone
TOTAL_BURST = 1000.0
MAX_SOURCES = 4096

OVER_SOURCE_RATE = "dropped_source_rate"
OVER_TOTAL_RATE = "dropped_total_rate"


@dataclass
class TokenBucket:
    """``rate_per_s`` tokens a second, at most ``burst`` saved up; starts full."""

    rate_per_s: float
    burst: float
    tokens: float
    at_ms: int

    @classmethod
    def full(cls, rate_per_s: float, burst: float, now_ms: int) -> TokenBucket:
        return cls(rate_per_s, burst, burst, now_ms)

    def _refill(self, now_ms: int) -> None:
        if now_ms > self.at_ms:
            gained = (now_ms - self.at_ms) * self.rate_per_s / 1000
            self.tokens = min(self.burst, self.tokens + gained)
            self.at_ms = now_ms

    def take(self, now_ms: int) -> bool:
        self._refill(now_ms)
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False

    def ready_at(self, now_ms: int) -> int:
        """When the next token is there (``now_ms`` if it is already)."""
        self._refill(now_ms)
        if self.tokens >= 1:
            return now_ms
        return now_ms + max(1, int((1 - self.tokens) * 1000 / self.rate_per_s) + 1)


class Admission:
    """Which received datagrams get any work, before the MAC check."""

    def __init__(
        self,
        per_source_rate: float = PER_SOURCE_RATE,
        per_source_burst: float = PER_SOURCE_BURST,
        total_rate: float = TOTAL_RATE,
        total_burst: float = TOTAL_BURST,
        max_sources: int = MAX_SOURCES,
    ) -> None:
        self.per_source_rate = per_source_rate
        self.per_source_burst = per_source_burst
        self.max_sources = max_sources
        self.total = TokenBucket.full(total_rate, total_burst, 0)
        self.sources: dict[str, TokenBucket] = {}

    def admit(self, source: str, now_ms: int) -> str | None:
        """None: go on with the datagram; else the reason it is dropped
        (a metric label: ``OVER_TOTAL_RATE`` or ``OVER_SOURCE_RATE``)."""
        if not self.total.take(now_ms):
            return OVER_TOTAL_RATE
        bucket = self.sources.get(source)
        if bucket is None:
            while len(self.sources) >= self.max_sources:
                del self.sources[next(iter(self.sources))]  # the oldest source
            bucket = TokenBucket.full(self.per_source_rate, self.per_source_burst, now_ms)
            self.sources[source] = bucket
        if not bucket.take(now_ms):
            return OVER_SOURCE_RATE
        return None

    def paused_until(self, now_ms: int) -> int | None:
        """While the total budget is spent: when reading may resume."""
        at = self.total.ready_at(now_ms)
        return at if at > now_ms else None
