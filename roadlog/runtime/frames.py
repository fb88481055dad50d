"""Framed links between roadlog's own processes: length-prefixed messages on
a TCP connection run by the event loop itself, in mutual TLS (the process's
credentials, ``roadlog.runtime.tls``; plaintext only when it runs
``--insecure``), opened with an HMAC challenge-response keyed by the
cluster secret.

They carry serialized protobuf messages without gRPC's machinery: no
event-engine or poller threads, so no cross-thread hand-over and wake-up per
message (bench/transport_hop.py: about 20-50 us per message side against
200-300 us for a gRPC aio stream under load). Each use (the Raft peer link,
the queue server's Work link) is a ``Scheme``: its own greeting, its own key
and its own frame limit, so a key for one never opens the other.

Wire format (all integers little-endian):
- The server speaks first: the scheme's 8-byte ``magic`` and a fresh 16-byte
  nonce.
- The client answers with a hello: its id (u64, not 0) and
  ``HMAC-SHA256(key, label | cluster | 0 | nonce | id)``, where the key is
  derived from the cluster secret and the scheme's label. Nothing is read
  from a connection before its hello checks out; a bad one (or none within
  ``HANDSHAKE_TIMEOUT_S``) closes the connection.
- Then frames, both ways: a u32 length and that many bytes.
- With TLS (the default), all of it inside a mutual TLS session: both ends
  present a certificate of the cluster's CA, and the hello's id must be the
  node id the client's certificate names (a node cannot speak for another).

Invariants:
- A frame longer than the scheme's ``max_frame`` (either way), or one the
  receiver refuses (its handler raises), closes the connection and is
  counted as rejected on the server; nothing of a refused connection
  reaches the receiver after the refusal.
- Frames reach the receiver in the order sent, each exactly once, on the
  event loop.
- Dead peers are noticed within seconds even when nothing is sent (TCP
  keepalive and ``TCP_USER_TIMEOUT``), as gRPC's keepalive did.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from roadlog.framing import FramedConn, GuardedListener
from roadlog.framing import OnFrame as OnFrame  # what a link's receiver is, here too
from roadlog.limits import WORK_MESSAGE_BYTES
from roadlog.link_limits import LinkGuard, LinkLimits
from roadlog.runtime import tls

log = logging.getLogger("roadlog.frames")

LINKS_CUT = Counter(
    "roadlog_framed_links_cut_total",
    "Framed links refused as they were accepted (a cap) or cut by a clock (idle, a frame "
    "or a hello not in time), by link and why",
    ["link", "why"],
)

NONCE_BYTES = 16
HELLO = struct.Struct("<Q32s")
# Notice a dead peer: idle probes after 2 s, 1 s apart, 2 missed; and data
# unacknowledged for 4 s drops the connection (TCP would retry for minutes).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 2, 1, 2
USER_TIMEOUT_MS = 4000
HANDSHAKE_TIMEOUT_S = 5.0


# What a link between roadlog's own processes may hold on its server's port
# (roadlog.link_limits): its peers have the cluster's certificates and
# secret, so the caps are for mistakes and for whoever reaches the port
# without them (who never gets past TLS or the hello). On loopback every
# process of a host shares one source address: the per-source caps are wide.
INTERNAL_LIMITS = LinkLimits(
    max_links=1024,
    max_links_per_source=512,
    max_strangers=128,
    max_strangers_per_source=64,
    handshake_s=HANDSHAKE_TIMEOUT_S,
    idle_s=300.0,
    frame_s=10.0,
    min_rate=256 << 10,
    buffer_bytes=256 << 20,
)


@dataclass(frozen=True)
class Scheme:
    """One use of framed links: the server's greeting, the label the hello
    and the key are made with, the largest frame either side takes, and
    what a server's port allows."""

    magic: bytes  # 8 bytes
    label: bytes
    max_frame: int
    limits: LinkLimits = INTERNAL_LIMITS

    def key(self, secret: bytes, cluster: str) -> bytes:
        """The key that authenticates this scheme's links (derived from the
        cluster secret, so no other credential grants it)."""
        return hmac.new(secret, self.label + b" key\x00" + cluster.encode(), "sha256").digest()

    def hello_mac(self, key: bytes, cluster: str, nonce: bytes, node_id: int) -> bytes:
        msg = self.label + b"\x00" + cluster.encode() + b"\x00" + nonce
        return hmac.new(key, msg + node_id.to_bytes(8, "little"), hashlib.sha256).digest()


# The queue server's Work link: WorkerMessages from the node, WorkItems to it.
WORK = Scheme(b"RLWORK01", b"roadlog work frames v1", WORK_MESSAGE_BYTES)


class _Conn(FramedConn):
    """Either end of a link of one ``Scheme``: its frame limit, its
    handshake's length, its keepalive; a refusal is logged."""

    KEEPALIVE = (KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT, USER_TIMEOUT_MS)

    def __init__(
        self,
        scheme: Scheme,
        head_bytes: int,
        guard: LinkGuard | None = None,
    ) -> None:
        super().__init__(scheme.max_frame, head_bytes, guard=guard)
        self.scheme = scheme

    def refuse(self, why: str) -> None:
        log.warning("framed link cut", extra={"scheme": self.scheme.label.decode(), "reason": why})
        self.abort()


class ServerConn(_Conn):
    """One accepted connection: checks the hello, then asks the server's
    ``on_open`` for the receiver of its frames. ``peer_id`` is the id that
    authenticated (0 until then)."""

    def __init__(self, server: FramedServer) -> None:
        super().__init__(server.scheme, HELLO.size, server.guard)
        self.server = server
        self.nonce = os.urandom(NONCE_BYTES)
        self.peer_id = 0
        self.cert_node = 0  # the node id the client's certificate names (with TLS)
        self.timer: asyncio.TimerHandle | None = None

    def _opened(self) -> None:
        assert self.transport is not None
        self.server.connections.add(self)
        if self.server.ssl is not None:
            ident = tls.ssl_identity(self.transport.get_extra_info("peercert"))
            self.cert_node = ident.node_id if ident is not None else 0
        self.transport.write(self.scheme.magic + self.nonce)
        self.timer = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT_S, self.refuse, "no hello in time"
        )

    def refuse(self, why: str) -> None:
        if not self.closed:
            self.server.on_reject()
        super().refuse(why)

    def _head_done(self) -> None:
        node_id, mac = HELLO.unpack_from(self.head)
        if self.timer is not None:
            self.timer.cancel()
        want = self.scheme.hello_mac(self.server.key, self.server.cluster, self.nonce, node_id)
        if node_id == 0 or not hmac.compare_digest(mac, want):
            self.refuse("bad hello")
            return
        if self.server.ssl is not None and node_id != self.cert_node:
            self.refuse(f"hello as node {node_id} with a certificate of node {self.cert_node}")
            return
        self.peer_id = node_id
        self.known()
        try:
            self.on_frame = self.server.on_open(self)
        except Exception as e:
            self.refuse(str(e) or type(e).__name__)

    def _ended(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.server.connections.discard(self)
        super()._ended(exc)


class FramedServer:
    """Accepts framed links of one scheme. ``on_open`` is called with each
    authenticated connection and returns the receiver of its frames (on the
    event loop, in the order the peer sent them; a receiver that raises
    cuts the connection); ``on_reject`` hears of each connection refused or
    cut off for bad input."""

    def __init__(
        self,
        scheme: Scheme,
        cluster: str,
        secret: bytes,
        on_open: Callable[[ServerConn], OnFrame],
        on_reject: Callable[[], None],
        ssl_context: ssl.SSLContext | tls.Default | None = tls.DEFAULT,
    ) -> None:
        """``ssl_context``: mutual TLS (default: the process's credentials,
        ``tls.current()``; None: plaintext)."""
        self.ssl: ssl.SSLContext | None = (
            tls.current().server_ssl() if isinstance(ssl_context, tls.Default) else ssl_context
        )
        self.scheme = scheme
        self.cluster = cluster
        self.key = scheme.key(secret, cluster)
        self.on_open = on_open
        self.on_reject = on_reject
        if scheme.max_frame > scheme.limits.buffer_bytes:
            raise ValueError(f"{scheme.label!r}: a frame may not be longer than the budget")
        self.guard = LinkGuard(scheme.limits, self._cut)
        self._listener = GuardedListener(self.guard, self._protocol, self.ssl)
        self.port = 0
        self.connections: set[ServerConn] = set()  # up (past TLS), until they end

    def _cut(self, why: str) -> None:
        LINKS_CUT.labels(self.name, why).inc()

    @property
    def name(self) -> str:
        """The link's name for logs and metrics ("work frames", "peer frames")."""
        return self.scheme.label.decode().removeprefix("roadlog ").removesuffix(" v1")

    def _protocol(self, source: str) -> ServerConn:
        p = ServerConn(self)
        p.source = source
        return p

    async def start(self, host: str, port: int) -> int:
        """Listen on (host, port); port 0 takes any free one. Returns the port."""
        self.port = self._listener.start(host, port)
        return self.port

    async def offer(self, host: str, port: int, without: str) -> int:
        """``start``, but a port that cannot be bound is a warning, not an
        error: returns 0, and the process goes on ``without`` the framed
        link (the gRPC stream serves instead). Logs where it listens."""
        name = self.name
        try:
            bound = await self.start(host, port)
        except OSError as e:
            log.warning(
                f"{name} off: cannot bind its port; {without}",
                extra={"port": port, "error": str(e)},
            )
            return 0
        log.info(f"{name} listening", extra={"port": bound})
        return bound

    async def close(self) -> None:
        self._listener.close()
        for c in list(self.connections):
            c.abort()


class ClientConn(_Conn):
    """The dialling end: waits for the greeting, then takes frames."""

    def __init__(self, scheme: Scheme, on_frame: OnFrame | None) -> None:
        super().__init__(scheme, len(scheme.magic) + NONCE_BYTES)
        self.nonce: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        # Nobody may be waiting any more when the link breaks: no warning then.
        self.nonce.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._receiver = on_frame  # None: the server sends no frames

    def _head_done(self) -> None:
        if not self.head.startswith(self.scheme.magic):
            self.nonce.set_exception(ConnectionError("not a framed link of this kind"))
            self.abort()
            return
        self.nonce.set_result(bytes(self.head[len(self.scheme.magic) :]))
        self.on_frame = self._receiver

    def _ended(self, exc: Exception | None) -> None:
        if not self.nonce.done():
            self.nonce.set_exception(exc or ConnectionError("the server closed the framed link"))
        super()._ended(exc)


async def connect(
    scheme: Scheme,
    host: str,
    port: int,
    cluster: str,
    secret: bytes,
    node_id: int,
    on_frame: OnFrame | None = None,
    ssl_context: ssl.SSLContext | tls.Default | None = tls.DEFAULT,
) -> ClientConn:
    """Dial a framed link and say hello as ``node_id``; ``on_frame`` gets
    the frames the server sends (None: it sends none). ``ssl_context``:
    mutual TLS (default: the process's credentials; None: plaintext); the
    server's certificate must name ``host``."""
    loop = asyncio.get_running_loop()
    ctx = tls.current().client_ssl() if isinstance(ssl_context, tls.Default) else ssl_context
    extra: dict[str, Any] = {}
    if ctx is not None:
        extra = {"ssl": ctx, "server_hostname": host.strip("[]")}
    transport, conn = await asyncio.wait_for(
        loop.create_connection(lambda: ClientConn(scheme, on_frame), host, port, **extra),
        HANDSHAKE_TIMEOUT_S,
    )
    try:
        nonce = await asyncio.wait_for(conn.nonce, HANDSHAKE_TIMEOUT_S)
        mac = scheme.hello_mac(scheme.key(secret, cluster), cluster, nonce, node_id)
        transport.write(HELLO.pack(node_id, mac))
    except BaseException:
        transport.abort()
        raise
    return conn
