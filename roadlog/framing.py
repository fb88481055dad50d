"""Length-prefixed frames over a byte stream: a u32 little-endian length
and that many bytes. ``FrameReader`` splits a stream into frames
(sans-I/O); ``FramedConn`` is a connection of them on the event loop.
Shared by roadlog's framed links between its own processes
(``roadlog.runtime.frames``) and the client SDK's publish link
(``roadlog.publish_link``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from typing import Any, cast

LEN = struct.Struct("<I")

# A frame's bytes: a big frame is the bytearray it was read into, typed as
# bytes (protobuf parses either; nobody may keep it and expect it immutable
# but its receiver, who owns it).
OnFrame = Callable[[bytes], None]


def tune_link(sock: Any, idle_s: int, interval_s: int, count: int, user_timeout_ms: int) -> None:
    """A framed link's socket: no Nagle delay (its messages wait for their
    answers), and a dead peer noticed even when nothing is sent: keepalive
    probes after ``idle_s``, ``interval_s`` apart, ``count`` missed; data
    unacknowledged for ``user_timeout_ms`` drops it (TCP alone would retry
    for minutes). None (no socket): nothing to do."""
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)


class FrameReader:
    """Splits a byte stream into frames (sans-I/O), reading in place: the
    caller fills ``get_buffer()`` (a socket's ``recv_into``) and reports how
    much came with ``updated``, which returns the frames it completed.

    Small frames are read many at a time into a scratch buffer and copied
    out once each; a frame over ``BIG_FRAME`` gets a buffer of its own,
    which the socket fills directly and which is handed on as it is (no copy
    at all). Raises ValueError on a frame longer than ``max_frame``."""

    SCRATCH = 256 << 10
    BIG_FRAME = 64 << 10

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame  # may be changed between reads (after a hello)
        self._scratch = bytearray(self.SCRATCH)
        self._view = memoryview(self._scratch)
        self._start = 0  # unread data in the scratch: [_start, _end)
        self._end = 0
        self._big: bytearray | None = None  # a big frame being filled
        self._big_have = 0

    def get_buffer(self) -> memoryview:
        """Where the next bytes go (never past the frame being filled)."""
        if self._big is not None:
            return memoryview(self._big)[self._big_have :]
        return self._view[self._end :]

    def updated(self, n: int) -> list[bytes]:
        """``n`` bytes were written at ``get_buffer()``: the frames completed."""
        if self._big is not None:
            self._big_have += n
            if self._big_have < len(self._big):
                return []
            done, self._big = self._big, None
            return [cast(bytes, done)]  # see OnFrame
        self._end += n
        frames: list[bytes] = []
        buf, view = self._scratch, self._view
        while self._end - self._start >= 4:
            (size,) = LEN.unpack_from(buf, self._start)
            if size > self.max_frame:
                raise ValueError(f"frame of {size} bytes is over the limit of {self.max_frame}")
            have = self._end - self._start - 4
            if have >= size:
                first = self._start + 4
                frames.append(bytes(view[first : first + size]))
                self._start = first + size
            elif size > self.BIG_FRAME:  # its own buffer, the socket fills it
                self._big = bytearray(size)
                self._big[:have] = view[self._start + 4 : self._end]
                self._big_have = have
                self._start = self._end = 0
                break
            else:
                break
        if self._start == self._end:
            self._start = self._end = 0
        elif len(buf) - self._start < 4 + self.BIG_FRAME:  # make room for a whole small frame
            rest = self._end - self._start
            buf[:rest] = view[self._start : self._end]
            self._start, self._end = 0, rest
        return frames

    def feed(self, data: bytes) -> list[bytes]:
        """The frames completed by ``data`` (copied in as a socket would)."""
        frames: list[bytes] = []
        pos = 0
        while pos < len(data):
            room = self.get_buffer()
            n = min(len(room), len(data) - pos)
            room[:n] = data[pos : pos + n]
            pos += n
            frames += self.updated(n)
        return frames

    @property
    def buffered(self) -> int:
        if self._big is not None:
            return self._big_have
        return self._end - self._start


class FramedConn(asyncio.BufferedProtocol):
    """What every framed link's ends share: frames in (to ``on_frame``),
    frames out with backpressure (``send``), and the end of the connection
    (``lost``).

    Reading is in place (a buffered protocol): first the handshake's fixed
    bytes (``head``, which ``_head_done`` checks; none when ``head_bytes``
    is 0), then frames through a ``FrameReader``, whose big frames the
    socket fills directly. Bad input (a frame over the limit, one the
    receiver raises on) never kills the process: ``refuse`` drops the
    connection. ``KEEPALIVE`` (``tune_link``'s idle s, interval s, count,
    user timeout ms) is each kind of link's."""

    KEEPALIVE: tuple[int, int, int, int]

    def __init__(self, max_frame: int, head_bytes: int) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader(max_frame)
        self.head = bytearray(head_bytes)  # the handshake's bytes, read before any frame
        self.head_have = 0
        self.on_frame: OnFrame | None = None  # set once the handshake is done
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        tune_link(transport.get_extra_info("socket"), *self.KEEPALIVE)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.head_have < len(self.head):
            return memoryview(self.head)[self.head_have :]
        return self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        if self.head_have < len(self.head):
            self.head_have += nbytes
            if self.head_have == len(self.head):
                self._head_done()
            return
        try:
            for f in self.reader.updated(nbytes):
                if self.on_frame is None:
                    raise ValueError("a frame where none is taken")
                self.on_frame(f)
                if self.closed:
                    return  # closed by the receiver: nothing more of it
        except Exception as e:  # bad input never kills the process: drop the connection
            self.refuse(str(e) or type(e).__name__)

    def _head_done(self) -> None:
        """The handshake's bytes are in (``head``)."""
        raise NotImplementedError

    def refuse(self, why: str) -> None:
        """Bad input: close the connection at once (``why``: for a log)."""
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
        await self.send_parts([payload])

    @property
    def writable(self) -> bool:
        """A frame written now goes out without waiting: the link is up and
        the socket's buffer is under its high mark."""
        return not self.lost.done() and self.transport is not None and self.can_write.is_set()

    def write_parts(self, parts: list[bytes]) -> None:
        """``send_parts`` without waiting, for a caller that saw ``writable``
        in the same turn of the event loop (or takes no backpressure)."""
        if self.transport is None or self.lost.done():
            raise ConnectionError("framed link is down")
        self.transport.writelines([LEN.pack(sum(len(p) for p in parts)), *parts])

    async def send_parts(self, parts: list[bytes]) -> None:
        """One frame whose payload is ``parts`` joined, written as they are
        (a writev; nothing is joined or copied here). Waits while the
        socket's buffer is over its high mark; raises ConnectionError once
        the link is down."""
        self.write_parts(parts)
        if not self.can_write.is_set():
            await self.can_write.wait()
            if self.lost.done():
                raise ConnectionError("framed link is down")

    async def wait_closed(self) -> None:
        await asyncio.shield(self.lost)
