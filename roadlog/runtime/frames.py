"""Framed links between roadlog's own processes: length-prefixed messages on
a plain TCP connection run by the event loop itself, opened with an HMAC
challenge-response keyed by the cluster secret.

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
import contextlib
import hashlib
import hmac
import logging
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from roadlog.limits import WORK_MESSAGE_BYTES

log = logging.getLogger("roadlog.frames")

NONCE_BYTES = 16
LEN = struct.Struct("<I")
HELLO = struct.Struct("<Q32s")
# Notice a dead peer: idle probes after 2 s, 1 s apart, 2 missed; and data
# unacknowledged for 4 s drops the connection (TCP would retry for minutes).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 2, 1, 2
USER_TIMEOUT_MS = 4000
HANDSHAKE_TIMEOUT_S = 5.0

OnFrame = Callable[[bytes], None]


@dataclass(frozen=True)
class Scheme:
    """One use of framed links: the server's greeting, the label the hello
    and the key are made with, and the largest frame either side takes."""

    magic: bytes  # 8 bytes
    label: bytes
    max_frame: int

    def key(self, secret: bytes, cluster: str) -> bytes:
        """The key that authenticates this scheme's links (derived from the
        cluster secret, so no other credential grants it)."""
        return hmac.new(secret, self.label + b" key\x00" + cluster.encode(), "sha256").digest()

    def hello_mac(self, key: bytes, cluster: str, nonce: bytes, node_id: int) -> bytes:
        msg = self.label + b"\x00" + cluster.encode() + b"\x00" + nonce
        return hmac.new(key, msg + node_id.to_bytes(8, "little"), hashlib.sha256).digest()


# The queue server's Work link: WorkerMessages from the node, WorkItems to it.
WORK = Scheme(b"RLWORK01", b"roadlog work frames v1", WORK_MESSAGE_BYTES)


def tune_socket(sock: socket.socket | None) -> None:
    """No Nagle delay; keepalive and a user timeout that notice a dead peer."""
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


class FrameReader:
    """Splits a byte stream into frames (sans-I/O): ``feed`` returns the
    frames completed by its data. Raises ValueError on a frame too long."""

    def __init__(self, max_frame: int) -> None:
        self._buf = bytearray()
        self._max = max_frame

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        frames: list[bytes] = []
        pos = 0
        end = len(buf)
        with memoryview(buf) as view:  # one copy per frame, out of the buffer
            while end - pos >= 4:
                (n,) = LEN.unpack_from(buf, pos)
                if n > self._max:
                    raise ValueError(f"frame of {n} bytes is over the limit of {self._max}")
                if end - pos - 4 < n:
                    break
                frames.append(bytes(view[pos + 4 : pos + 4 + n]))
                pos += 4 + n
        if pos:
            del buf[:pos]
        return frames

    @property
    def buffered(self) -> int:
        return len(self._buf)


def frame(payload: bytes) -> tuple[bytes, bytes]:
    """A frame as (header, payload), for ``writelines`` (no concatenation)."""
    return LEN.pack(len(payload)), payload


class _Conn(asyncio.Protocol):
    """What both ends share: frames in (to ``on_frame``), frames out with
    backpressure (``send``), and the end of the connection (``lost``)."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader(scheme.max_frame)
        self.on_frame: OnFrame | None = None  # set once the handshake is done
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        tune_socket(transport.get_extra_info("socket"))

    def _frames(self, data: bytes) -> None:
        """Hand the frames in ``data`` on; a refused one ends the connection."""
        try:
            for f in self.reader.feed(data):
                assert self.on_frame is not None
                self.on_frame(f)
                if self.lost.done():
                    return  # closed by the receiver: nothing more of it
        except Exception as e:  # bad input never kills the process: drop the connection
            self.refuse(str(e) or type(e).__name__)

    def refuse(self, why: str) -> None:
        log.warning("framed link cut", extra={"scheme": self.scheme.label.decode(), "reason": why})
        self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self._ended(ConnectionError("framed link closed"))

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(exc)

    def _ended(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self.can_write.set()

    @property
    def closed(self) -> bool:
        return self.lost.done()

    async def send(self, payload: bytes) -> None:
        """Queue one frame; waits while the socket's buffer is over its high
        mark. Raises ConnectionError once the link is down."""
        if self.lost.done() or self.transport is None:
            raise ConnectionError("framed link is down")
        self.transport.writelines(frame(payload))
        if not self.can_write.is_set():
            await self.can_write.wait()
            if self.lost.done():
                raise ConnectionError("framed link is down")

    async def wait_closed(self) -> None:
        await asyncio.shield(self.lost)


class ServerConn(_Conn):
    """One accepted connection: checks the hello, then asks the server's
    ``on_open`` for the receiver of its frames. ``peer_id`` is the id that
    authenticated (0 until then)."""

    def __init__(self, server: FramedServer) -> None:
        super().__init__(server.scheme)
        self.server = server
        self.nonce = os.urandom(NONCE_BYTES)
        self.peer_id = 0
        self.hello = bytearray()
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.transport.write(self.scheme.magic + self.nonce)
        self.timer = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT_S, self.refuse, "no hello in time"
        )

    def refuse(self, why: str) -> None:
        if not self.closed:
            self.server.on_reject()
        super().refuse(why)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if not self.peer_id:
            self.hello += data
            if len(self.hello) < HELLO.size:
                return
            node_id, mac = HELLO.unpack_from(self.hello)
            rest = bytes(self.hello[HELLO.size :])
            self.hello = bytearray()
            if self.timer is not None:
                self.timer.cancel()
            want = self.scheme.hello_mac(self.server.key, self.server.cluster, self.nonce, node_id)
            if node_id == 0 or not hmac.compare_digest(mac, want):
                self.refuse("bad hello")
                return
            self.peer_id = node_id
            try:
                self.on_frame = self.server.on_open(self)
            except Exception as e:
                self.refuse(str(e) or type(e).__name__)
                return
            data = rest
            if not data:
                return
        self._frames(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.server.connections.discard(self)
        super().connection_lost(exc)


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
    ) -> None:
        self.scheme = scheme
        self.cluster = cluster
        self.key = scheme.key(secret, cluster)
        self.on_open = on_open
        self.on_reject = on_reject
        self.port = 0
        self.connections: set[ServerConn] = set()
        self._server: asyncio.AbstractServer | None = None

    def _protocol(self) -> ServerConn:
        p = ServerConn(self)
        self.connections.add(p)
        return p

    async def start(self, host: str, port: int) -> int:
        """Listen on (host, port); port 0 takes any free one. Returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, host or None, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for c in list(self.connections):
                c.abort()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)


class ClientConn(_Conn):
    """The dialling end: waits for the greeting, then takes frames."""

    def __init__(self, scheme: Scheme, on_frame: OnFrame | None) -> None:
        super().__init__(scheme)
        self.greeting = bytearray()
        self.nonce: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        # Nobody may be waiting any more when the link breaks: no warning then.
        self.nonce.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._receiver = on_frame

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if not self.nonce.done():
            self.greeting += data
            head = len(self.scheme.magic) + NONCE_BYTES
            if len(self.greeting) < head:
                return
            if not self.greeting.startswith(self.scheme.magic):
                self.nonce.set_exception(ConnectionError("not a framed link of this kind"))
                self.abort()
                return
            self.nonce.set_result(bytes(self.greeting[len(self.scheme.magic) : head]))
            data = bytes(self.greeting[head:])
            self.greeting = bytearray()
            if not data:
                return
        if self._receiver is None:
            self.refuse("frames from a server that sends none")
            return
        self.on_frame = self._receiver
        self._frames(data)

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
) -> ClientConn:
    """Dial a framed link and say hello as ``node_id``; ``on_frame`` gets
    the frames the server sends (None: it sends none)."""
    loop = asyncio.get_running_loop()
    transport, conn = await asyncio.wait_for(
        loop.create_connection(lambda: ClientConn(scheme, on_frame), host, port),
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
