"""The publish link: a client's PublishBatch calls to a queue server over
one length-prefixed framed TCP connection (``roadlog.framing``), in TLS
that trusts the cluster's CA as the gRPC channel does (plaintext only to a
cluster run ``--insecure``), instead of the gRPC ``PublishStream``.

It carries the same messages (``PublishStreamRequest`` out,
``PublishStreamResponse`` back, matched by id) without gRPC's machinery:
no poller thread, so no hand-over between threads and no wake-up per
message (bench/transport_hop.py: 20-50 us a hop against 200-300 us for a
gRPC aio stream under load). A queue server offers it in the initial
metadata of the PublishStream (``PORT_METADATA``: its port); a client that
does not find it, or cannot reach it, stays on gRPC.

Wire format (integers little-endian):
- The server speaks first: ``MAGIC`` (8 bytes).
- The client's hello, one frame: a u16 length of its declared client id and
  a u16 length of its credential (the ``authorization`` value it would send
  gRPC: ``Bearer TOKEN``, or empty), then both, UTF-8; at most
  ``MAX_HELLO_BYTES``. The server checks the credential and answers with an
  empty frame; or, refusing it, with a frame saying why (UTF-8, starting
  with the gRPC code's name) and closes the link. The client sends nothing
  else before that answer (anything that does closes the link).
- Then frames both ways, a u32 length and that many bytes: the client's
  ``PublishStreamRequest`` messages, the server's ``PublishStreamResponse``.

The hello says who asks, and only a good credential opens the link; the
queue server still admits every batch on its own (credential, scope and
rate checked), exactly as a gRPC ``PublishBatch`` with the same metadata, so
a token revoked while the link is open stops working at the next batch.

Invariants: frames arrive in the order sent, each once, on the event loop;
a frame longer than the receiver's limit, or a greeting or hello that is
not one, closes the connection; once closed, ``lost`` is done and nothing
more is received.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from typing import Any

from roadlog.framing import FramedConn, OnFrame

MAGIC = b"RLPUB\x00v1"
HELLO_HEAD = struct.Struct("<HH")
MAX_HELLO_BYTES = 4096
MAX_CLIENT_ID_BYTES = 128
HANDSHAKE_TIMEOUT_S = 5.0
PORT_METADATA = "roadlog-publish-link-port"


def encode_hello(client: str, credential: str | None) -> bytes:
    """The hello frame's payload."""
    cid, cred = client.encode()[:MAX_CLIENT_ID_BYTES], (credential or "").encode()
    if HELLO_HEAD.size + len(cid) + len(cred) > MAX_HELLO_BYTES:
        raise ValueError(f"a credential of {len(cred)} bytes does not fit a hello")
    return HELLO_HEAD.pack(len(cid), len(cred)) + cid + cred


def decode_hello(frame: bytes) -> tuple[str, str | None]:
    """The declared client id and the credential (None: none) of a hello;
    ValueError when it is not one."""
    if len(frame) < HELLO_HEAD.size:
        raise ValueError("a hello too short for its head")
    n_cid, n_cred = HELLO_HEAD.unpack_from(frame)
    if n_cid > MAX_CLIENT_ID_BYTES or HELLO_HEAD.size + n_cid + n_cred != len(frame):
        raise ValueError("a hello whose lengths do not add up")
    at = HELLO_HEAD.size
    try:
        cid = frame[at : at + n_cid].decode()
        cred = frame[at + n_cid :].decode()
    except UnicodeDecodeError:
        raise ValueError("a hello that is not UTF-8") from None
    return cid, cred or None


# Notice a dead end within seconds even when nothing is sent (a queue
# server's host gone: the client sends its batches elsewhere; a client gone:
# the server stops holding its answers): idle probes after 5 s, 2 s apart, 3
# missed; data unacknowledged for 10 s drops the connection (TCP would retry
# for minutes). Laxer than the links between roadlog's own processes
# (roadlog.runtime.frames), as clients sit on slower networks.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 5, 2, 3
USER_TIMEOUT_MS = 10_000
KEEPALIVE = (KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT, USER_TIMEOUT_MS)


class HelloRefused(ConnectionError):
    """The queue server refused the hello (its reason: the message); the
    client publishes over gRPC, where the same credential gets its status."""


class PublishLink(FramedConn):
    """The client's end: checks the server's greeting, then its answer to
    the hello (``ready``), then hands each answer frame to ``on_frame``."""

    KEEPALIVE = KEEPALIVE

    def __init__(self, max_frame: int, on_frame: OnFrame) -> None:
        super().__init__(max_frame, head_bytes=len(MAGIC))
        loop = asyncio.get_running_loop()
        self.greeted: asyncio.Future[None] = loop.create_future()
        self.ready: asyncio.Future[None] = loop.create_future()
        for f in (self.greeted, self.ready):
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._receiver = on_frame

    def _head_done(self) -> None:
        if bytes(self.head) != MAGIC:
            self.greeted.set_exception(ConnectionError("not a publish link"))
            self.abort()
            return
        self.on_frame = self._hello_answered
        self.greeted.set_result(None)

    def _hello_answered(self, frame: bytes) -> None:
        if frame:  # refused: the server says why and closes the link
            why = bytes(frame).decode(errors="replace")
            self.ready.set_exception(HelloRefused(why))
            self.abort()
            return
        self.on_frame = self._receiver
        self.ready.set_result(None)

    def _ended(self, exc: Exception | None) -> None:
        for f in (self.greeted, self.ready):
            if not f.done():
                f.set_exception(ConnectionError("the server closed the publish link"))
        super()._ended(exc)


async def open_link(
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    client: str,
    credential: str | None,
    on_frame: OnFrame,
    max_frame: int,
) -> PublishLink:
    """Dial a queue server's publish link and say hello; ``on_frame`` gets
    its answers. ``ssl_context`` None: plaintext; else the server's
    certificate must name ``host``."""
    loop = asyncio.get_running_loop()
    extra: dict[str, Any] = {}
    if ssl_context is not None:
        extra = {"ssl": ssl_context, "server_hostname": host}
    _, link = await asyncio.wait_for(
        loop.create_connection(lambda: PublishLink(max_frame, on_frame), host, port, **extra),
        HANDSHAKE_TIMEOUT_S,
    )
    try:
        await asyncio.wait_for(asyncio.shield(link.greeted), HANDSHAKE_TIMEOUT_S)
        link.write_parts([encode_hello(client, credential)])
        await asyncio.wait_for(asyncio.shield(link.ready), HANDSHAKE_TIMEOUT_S)
    except BaseException:
        link.abort()
        raise
    return link
