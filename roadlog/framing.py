"""Length-prefixed frames over a byte stream: a u32 little-endian length
and that many bytes. ``FrameReader`` splits a stream into frames
(sans-I/O); ``FramedConn`` is a connection of them on the event loop.
Shared by roadlog's framed links between its own processes
(``roadlog.runtime.frames``) and the client SDK's publish link
(``roadlog.publish_link``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
from collections.abc import Callable
from typing import Any, cast

from roadlog.link_limits import LinkGuard, source_key

log = logging.getLogger("roadlog.framing")

LEN = struct.Struct("<I")
_HANDSHAKES: set[asyncio.Task[None]] = set()  # TLS handshakes under way (kept from the GC)

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

    Small frames are read many at a time into a scratch buffer (``scratch``
    bytes, made at the first read) and copied out once each; a frame over
    ``BIG_FRAME`` gets a buffer of its own, which the socket fills directly
    and which is handed on as it is (no copy). That buffer grows as the
    frame's bytes arrive (first ``FIRST_BIG`` or what came, then ``GROWTH``
    times as much each time it is full), never to more than the frame's
    length and never from its header's claim alone. Raises ValueError on a
    frame longer than ``max_frame``.

    With a ``budget``, a big frame's buffer is taken from it and given back
    when the frame is handed on or the reader is released (``release``). When the budget
    cannot cover the next growth the reader is ``starved``: its owner stops
    reading and calls ``retry`` once bytes come back. If the socket still
    offers bytes meanwhile, the buffer grows by ``STEP`` beyond the budget
    (a bounded overdraft: at most what the scratch held plus ``STEP``)."""

    SCRATCH = 256 << 10
    BIG_FRAME = 64 << 10
    FIRST_BIG = 256 << 10
    GROWTH = 4
    STEP = 64 << 10

    def __init__(self, max_frame: int, scratch: int = SCRATCH, budget: Any = None) -> None:
        """``budget``: a ``roadlog.link_limits.FrameBudget`` (None: none)."""
        self.max_frame = max_frame  # may be changed between reads (``widen``)
        self.budget = budget
        self._scratch_size = scratch
        self._big_at = min(self.BIG_FRAME, scratch - 4)  # longer frames get their own buffer
        self._scratch = bytearray()  # made at the first read
        self._view = memoryview(self._scratch)
        self._start = 0  # unread data in the scratch: [_start, _end)
        self._end = 0
        self._big: bytearray | None = None  # a big frame being filled
        self._big_have = 0
        self._big_size = 0  # its length
        self._held = 0  # bytes of the budget the big buffer holds
        self.frames = 0  # frames completed, ever
        self.starved = False

    def get_buffer(self) -> memoryview:
        """Where the next bytes go (never past the frame being filled)."""
        big = self._big
        if big is not None:
            if self._big_have == len(big):  # starved, and bytes still come
                self._grow(force=True)
                big = cast(bytearray, self._big)
            return memoryview(big)[self._big_have :]
        if not self._scratch:
            self._scratch = bytearray(self._scratch_size)
            self._view = memoryview(self._scratch)
        return self._view[self._end :]

    def updated(self, n: int) -> list[bytes]:
        """``n`` bytes were written at ``get_buffer()``: the frames completed."""
        if self._big is not None:
            self._big_have += n
            if self._big_have < self._big_size:
                if self._big_have == len(self._big):
                    self._grow(force=False)
                return []
            done = self._big
            self._drop_big()
            self.frames += 1
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
            elif size > self._big_at:  # its own buffer, the socket fills it
                self._begin_big(size, view[self._start + 4 : self._end])
                self._start = self._end = 0
                break
            else:
                break
        self.frames += len(frames)
        if self._start == self._end:
            self._start = self._end = 0
        elif len(buf) - self._start < 4 + self._big_at:  # make room for a whole small frame
            rest = self._end - self._start
            buf[:rest] = view[self._start : self._end]
            self._start, self._end = 0, rest
        return frames

    def _begin_big(self, size: int, have: memoryview) -> None:
        cap = min(size, max(self.FIRST_BIG, self.GROWTH * len(have)))
        if self.budget is not None and not self.budget.take(cap):
            cap = min(size, len(have) + self.STEP)
            self.budget.force(cap)
            self.starved = True
        self._held = cap if self.budget is not None else 0
        self._big = bytearray(cap)
        self._big[: len(have)] = have
        self._big_have, self._big_size = len(have), size

    def _grow(self, force: bool) -> bool:
        """A fuller buffer for the big frame (it is full); False: the budget
        could not cover it (``starved``; ``force``: grown by STEP anyway)."""
        old = self._big
        assert old is not None
        cap = min(self._big_size, len(old) * self.GROWTH)
        if self.budget is not None and not self.budget.take(cap - len(old)):
            self.starved = True
            if not force:
                return False
            cap = min(self._big_size, len(old) + self.STEP)
            self.budget.force(cap - len(old))
        else:
            self.starved = False
        if self.budget is not None:
            self._held += cap - len(old)
        new = bytearray(cap)
        new[: self._big_have] = memoryview(old)[: self._big_have]
        self._big = new
        return not self.starved

    def retry(self) -> bool:
        """After ``starved``: take the growth from the budget now; True when
        the reader may read again."""
        if not self.starved:
            return True
        if self._big is None or self._big_have < len(self._big):
            self.starved = False  # room left (the overdraft's, or none needed any more)
            return True
        return self._grow(force=False)

    def _drop_big(self) -> None:
        self._big = None
        self._big_have = self._big_size = 0
        self.starved = False
        if self._held:
            held, self._held = self._held, 0
            self.budget.give(held)

    def release(self) -> None:
        """Give back what the reader holds of the budget (its link is gone)."""
        self._drop_big()

    def widen(self, max_frame: int, scratch: int) -> list[bytes]:
        """Take frames up to ``max_frame`` from now on, in a scratch of
        ``scratch`` bytes (after a hello read in a small one); returns the
        frames already whole in what was read."""
        rest = bytes(self._view[self._start : self._end])
        self.max_frame = max_frame
        self._scratch_size = scratch
        self._big_at = min(self.BIG_FRAME, scratch - 4)
        self._scratch = bytearray(scratch)
        self._view = memoryview(self._scratch)
        self._start, self._end = 0, 0
        return self.feed(rest) if rest else []

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

    @property
    def pending(self) -> int:
        """The length (with its header) of the frame begun and not whole; 0: none."""
        if self._big is not None:
            return 4 + self._big_size
        have = self._end - self._start
        if have >= 4:
            return 4 + int(LEN.unpack_from(self._scratch, self._start)[0])
        return 4 if have else 0

    @property
    def capacity(self) -> int:
        """Bytes of buffer the reader holds now (its scratch and a big frame's)."""
        return len(self._scratch) + (len(self._big) if self._big is not None else 0)


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
    user timeout ms) is each kind of link's.

    A server's end is ``guarded`` (``roadlog.link_limits``): the guard
    admits it as it is accepted, before any TLS (``server_tls``: the
    handshake is started here, once admitted), its reader draws on the
    guard's budget, and ``_opened`` runs once the link is up."""

    KEEPALIVE: tuple[int, int, int, int]

    def __init__(
        self,
        max_frame: int,
        head_bytes: int,
        *,
        guard: LinkGuard | None = None,
        server_tls: ssl.SSLContext | None = None,
        scratch: int = FrameReader.SCRATCH,
    ) -> None:
        self.transport: asyncio.Transport | None = None
        self.guard = guard
        self.server_tls = server_tls
        self.reader = FrameReader(max_frame, scratch, guard.budget if guard is not None else None)
        self.head = bytearray(head_bytes)  # the handshake's bytes, read before any frame
        self.head_have = 0
        self.on_frame: OnFrame | None = None  # set once the handshake is done
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.source = ""  # the peer's address (a guarded end's)
        self.authenticated = False  # past its hello (the guard's word: no longer a stranger)
        self.received = 0  # bytes, ever
        self._raw: asyncio.Transport | None = None  # the TCP transport under TLS
        self._starved = False  # not reading: waiting for the budget
        self._paused = False  # not reading: the receiver's choice (``pause``)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.guard is None:
            self._open(transport)
            return
        self._raw = raw = cast(asyncio.Transport, transport)
        peer = raw.get_extra_info("peername")
        self.source = source_key(str(peer[0])) if isinstance(peer, tuple) and peer else ""
        why = self.guard.admit(self)
        if why:
            log.debug("framed link refused at accept", extra={"source": self.source, "cap": why})
            raw.abort()
            self._ended(ConnectionRefusedError(why))
            return
        if self.server_tls is None:
            self._open(raw)
            return
        raw.pause_reading()  # nothing is read until the TLS handshake reads it
        task = asyncio.get_running_loop().create_task(self._start_tls(raw))
        _HANDSHAKES.add(task)
        task.add_done_callback(_HANDSHAKES.discard)

    async def _start_tls(self, raw: asyncio.Transport) -> None:
        assert self.guard is not None and self.server_tls is not None
        loop = asyncio.get_running_loop()
        try:
            wrapped = await loop.start_tls(
                raw,
                self,
                self.server_tls,
                server_side=True,
                ssl_handshake_timeout=self.guard.limits.handshake_s,
            )
        except (OSError, ssl.SSLError, ConnectionError, TimeoutError, RuntimeError) as e:
            raw.abort()
            self._ended(e)
            return
        if wrapped is None or self.closed:
            if wrapped is not None:
                wrapped.abort()
            return
        self._open(wrapped)

    def _open(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        tune_link(transport.get_extra_info("socket"), *self.KEEPALIVE)
        self._opened()

    def _opened(self) -> None:
        """The link is up (after TLS, when there is TLS): ``transport`` is set."""

    def known(self) -> None:
        """The peer passed its hello: a guarded end stops counting as a stranger."""
        if self.guard is not None:
            self.guard.known(self)
        else:
            self.authenticated = True

    # -- what a guard reads (roadlog.link_limits.Guarded)

    def clocks(self) -> tuple[int, int, int]:
        return self.received, self.reader.frames, self.reader.pending

    @property
    def paused_by_us(self) -> bool:
        return self._starved or self._paused

    def close_idle(self, why: str) -> None:
        """Close a link that has been quiet too long (no bad input: no refusal)."""
        log.info("framed link closed", extra={"source": self.source, "reason": why})
        self.abort()

    def pause(self, paused: bool) -> None:
        """Read or not, by the receiver's choice (its backpressure)."""
        self._paused = paused
        self._set_reading()

    def _set_reading(self) -> None:
        if self.transport is None or self.closed:
            return
        if self._starved or self._paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def _starve(self) -> None:
        """The reader's budget ran out: read nothing until bytes come back."""
        self._starved = True
        self._set_reading()
        assert self.guard is not None
        self.guard.budget.wait(self._fed)

    def _fed(self) -> bool:
        if self.closed:
            return True  # nothing more to take for it
        if not self.reader.retry():
            assert self.guard is not None
            self.guard.budget.wait(self._fed)
            return False
        self._starved = False
        self._set_reading()
        return True

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.head_have < len(self.head):
            return memoryview(self.head)[self.head_have :]
        return self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        self.received += nbytes
        if self.head_have < len(self.head):
            self.head_have += nbytes
            if self.head_have == len(self.head):
                self._head_done()
            return
        try:
            self.deliver(self.reader.updated(nbytes))
        except Exception as e:  # bad input never kills the process: drop the connection
            self.refuse(str(e) or type(e).__name__)
            return
        if self.reader.starved and not self._starved and not self.closed:
            self._starve()

    def deliver(self, frames: list[bytes]) -> None:
        """Hand frames to the receiver, in order, until one closes the link."""
        for f in frames:
            if self.on_frame is None:
                raise ValueError("a frame where none is taken")
            self.on_frame(f)
            if self.closed:
                return  # closed by the receiver: nothing more of it

    def _head_done(self) -> None:
        """The handshake's bytes are in (``head``)."""
        raise NotImplementedError

    def refuse(self, why: str) -> None:
        """Bad input: close the connection at once (``why``: for a log)."""
        self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        elif self._raw is not None:  # still in its TLS handshake
            self._raw.abort()
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
        self.reader.release()
        if self.guard is not None:
            self.guard.gone(self)

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
