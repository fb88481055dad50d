"""The asyncio UDP adapter around ``DiscoveryCore``: sends the HELLO that
is due to the broadcast address and to every seed, feeds what arrives to
the core, and answers a newcomer at once with a unicast HELLO (so it learns
the membership and the leader without waiting for the next broadcast).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

from prometheus_client import Counter

from discovery.core import DiscoveryCore
from discovery.protocol import Hello, encode

log = logging.getLogger("roadlog.discovery")

DATAGRAMS = Counter(
    "roadlog_discovery_datagrams_total",
    "discovery datagrams received, by outcome (accepted or why rejected)",
    ["outcome"],
)
SENT = Counter("roadlog_discovery_sent_total", "discovery datagrams sent")
STEP_S = 0.1


def now_ms() -> int:
    return int(time.time() * 1000)


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, agent: DiscoveryAgent) -> None:
        self.agent = agent

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        self.agent.received(data, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("discovery socket error", extra={"error": str(exc)})


class DiscoveryAgent:
    def __init__(
        self,
        core: DiscoveryCore,
        key: bytes,
        port: int,
        broadcast: str = "255.255.255.255",
        seeds: list[str] | None = None,
        bind: str = "0.0.0.0",
        listen: bool = True,
    ) -> None:
        """``port``: where HELLOs go (and, with ``listen``, where this agent
        receives them); without ``listen`` it only announces, from an
        ephemeral port (a queue server next to a node on one host)."""
        self.core = core
        self.key = key
        self.port = port
        self.broadcast = broadcast
        self.seeds = [_hostport(s) for s in seeds or []]
        self.bind = bind
        self.listen = listen
        self.transport: asyncio.DatagramTransport | None = None
        self._task: asyncio.Task[None] | None = None
        self._answered: dict[int, int] = {}
        self.listeners: list[Callable[[], None]] = []  # called after every step
        self._reported: dict[str, int] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.bind((self.bind, self.port if self.listen else 0))
        transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(self), sock=sock)
        self.transport = transport
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
        if self.transport is not None:
            self.transport.close()

    def received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        now = now_ms()
        h = self.core.receive(data, self.key, now)
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
            for fn in self.listeners:
                try:
                    fn()
                except Exception:
                    log.exception("discovery listener failed")
            await asyncio.sleep(STEP_S)

    def _send(self, h: Hello, targets: list[tuple[str, int]]) -> None:
        if self.transport is None:
            return
        data = encode(h, self.key)
        for t in targets:
            try:
                self.transport.sendto(data, t)
                SENT.inc()
            except OSError as e:
                log.debug("discovery send failed", extra={"to": t, "error": str(e)})

    def _export_counters(self) -> None:
        for k, v in self.core.counters.items():
            d = v - self._reported.get(k, 0)
            if d:
                DATAGRAMS.labels(k).inc(d)
                self._reported[k] = v


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)
