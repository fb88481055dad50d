"""The asyncio UDP adapter around ``DiscoveryCore``: sends the HELLO that
is due to the broadcast address and to every seed, feeds what arrives to
the core, and answers a newcomer at once with a unicast HELLO (so it learns
the membership and the leader without waiting for the next broadcast).

It reads its socket itself (``add_reader``, at most ``BATCH`` datagrams a
wakeup) rather than through a datagram transport, so that it can stop
reading while the core's admission budget is spent (issue 19, finding 16):
uvloop's UDP transport cannot pause. Datagrams a flood sends meanwhile are
dropped by the kernel, at no cost to the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable

from prometheus_client import Counter

from discovery.core import DiscoveryCore
from discovery.protocol import Hello, discovery_key, encode

log = logging.getLogger("roadlog.discovery")

DATAGRAMS = Counter(
    "roadlog_discovery_datagrams_total",
    "discovery datagrams received, by outcome (accepted or why rejected)",
    ["outcome"],
)
SENT = Counter("roadlog_discovery_sent_total", "discovery datagrams sent")
PAUSES = Counter(
    "roadlog_discovery_read_pauses_total",
    "times reading the discovery socket paused because the datagram budget was spent",
)
STEP_S = 0.1
BATCH = 64  # datagrams read per wakeup at most
RECV_BYTES = 2048  # more than MAX_DATAGRAM: a longer datagram is cut, then refused
# What the kernel dropped for this socket (its buffer full, e.g. while we do
# not read): Linux's SO_MEMINFO (<linux/sock_diag.h>), not in Python's socket.
SO_MEMINFO = 55
SK_MEMINFO_DROPS = 8
UNREAD = "dropped_unread"


def now_ms() -> int:
    return int(time.time() * 1000)


class DiscoveryAgent:
    def __init__(
        self,
        core: DiscoveryCore,
        secret: bytes,
        port: int,
        broadcast: str = "255.255.255.255",
        seeds: list[str] | None = None,
        bind: str = "0.0.0.0",
        listen: bool = True,
    ) -> None:
        """``port``: where HELLOs go (and, with ``listen``, where this agent
        receives them); without ``listen`` it only announces, from an
        ephemeral port (a queue server next to a node on one host). HELLOs
        are signed and checked with the key derived from ``secret``."""
        self.core = core
        self.key = discovery_key(secret)
        self.port = port
        self.broadcast = broadcast
        self.seeds = [_hostport(s) for s in seeds or []]
        self.bind = bind
        self.listen = listen
        self.sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resume: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._answered: dict[int, int] = {}
        self.listeners: list[Callable[[], None]] = []  # called after every step
        self._reported: dict[str, int] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        try:
            sock.bind((self.bind, self.port if self.listen else 0))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self.sock, self._loop = sock, loop
        loop.add_reader(sock.fileno(), self._readable)
        self._task = loop.create_task(self._run())
        log.info(
            "discovery started",
            extra={
                "port": self.port,
                "broadcast": self.broadcast,
                "seeds": [f"{h}:{p}" for h, p in self.seeds],
                "node_id": self.core.node_id,
            },
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._resume is not None:
            self._resume.cancel()
        if self.sock is not None and self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def _readable(self) -> None:
        """The socket has datagrams: read up to BATCH, or until the budget
        is spent (then stop reading until it refills)."""
        assert self.sock is not None and self._loop is not None
        for _ in range(BATCH):
            try:
                data, addr = self.sock.recvfrom(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. an ICMP error for an earlier send
                log.debug("discovery socket error", extra={"error": str(e)})
                continue
            self.received(data, addr)
            now = now_ms()
            resume = self.core.admission.paused_until(now)
            if resume is not None:
                PAUSES.inc()
                self._loop.remove_reader(self.sock.fileno())
                self._resume = self._loop.call_later((resume - now) / 1000, self._read_again)
                return

    def _read_again(self) -> None:
        self._resume = None
        if self.sock is not None and self._loop is not None:
            self._loop.add_reader(self.sock.fileno(), self._readable)

    def received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        now = now_ms()
        h = self.core.receive(data, self.key, now, str(addr[0]))
        self._export_counters()
        if h is None or not self.core.member or h.state != "new":
            return
        if now - self._answered.get(h.node_id, 0) >= self.core.interval_ms:
            self._answered[h.node_id] = now  # a newcomer: tell it who we are now
            self._send(self.core.hello(now), [(str(addr[0]), int(addr[1]))])

    async def _run(self) -> None:
        while True:
            now = now_ms()
            h = self.core.due(now)
            if h is not None:
                targets = list(self.seeds)
                if self.broadcast:
                    targets.append((self.broadcast, self.port))
                self._send(h, targets)
            self._count_kernel_drops()
            self._export_counters()
            for fn in self.listeners:
                try:
                    fn()
                except Exception:
                    log.exception("discovery listener failed")
            await asyncio.sleep(STEP_S)

    def _count_kernel_drops(self) -> None:
        """The datagrams the kernel dropped for us so far (a flood while
        reading is paused), as the core's ``dropped_unread`` counter."""
        if self.sock is None:
            return
        try:
            raw = self.sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * (SK_MEMINFO_DROPS + 1))
        except OSError:
            return  # not Linux, or too old a kernel: not counted
        if len(raw) >= 4 * (SK_MEMINFO_DROPS + 1):
            self.core.counters[UNREAD] = struct.unpack_from("I", raw, 4 * SK_MEMINFO_DROPS)[0]

    def _send(self, h: Hello, targets: list[tuple[str, int]]) -> None:
        if self.sock is None:
            return
        data = encode(h, self.key)
        for t in targets:
            try:
                self.sock.sendto(data, t)  # non-blocking: a full buffer drops this HELLO
                SENT.inc()
            except OSError as e:
                log.debug("discovery send failed", extra={"to": t, "error": str(e)})

    def _export_counters(self) -> None:
        for k, v in self.core.counters.items():
            d = v - self._reported.get(k, 0)
            if d > 0:  # (the kernel's u32 drop count may wrap)
                DATAGRAMS.labels(k).inc(d)
            self._reported[k] = v


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)
