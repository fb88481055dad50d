"""Length-prefixed frames over a byte stream: a u32 little-endian length
and that many bytes. ``FrameReader`` splits a stream into frames
(sans-I/O); ``FramedConn`` is a connection of them on the event loop.
Shared by roadlog's framed links between its own processes
(``roadlog.runtime.frames``) and the client SDK's publish link
(``roadlog.publish_link``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
import struct
from collections.abc import Callable
from typing import Any, cast

from roadlog.link_limits import LinkGuard, source_key

log = logging.getLogger("roadlog.framing")

LEN = struct.Struct("<I")
# Over TLS, the parts of a frame are joined into chunks of up to this many
# bytes before they are written (``tls_chunks``).
TLS_CHUNK = 256 << 10


def tls_chunks(parts: list[bytes], limit: int = TLS_CHUNK) -> list[bytes]:
    """``parts`` (a frame's length prefix and payload) as few pieces for a
    TLS transport: runs of parts joined into chunks of at most ``limit``
    bytes; a part of ``limit`` bytes or more goes as it is, alone.

    Invariant: ``b"".join(tls_chunks(p)) == b"".join(p)``. A TLS transport
    (uvloop's, asyncio's) encrypts each piece it is handed as one TLS record
    at least, so a frame written as its parts (a 4-byte length, a header, a
    message: a heartbeat is four) cost a record, its AES-GCM pass and its
    decryption on the far side per part; joined, a small frame is one record.
    TLS copies every byte anyway, so the join costs little; the limit keeps
    a big frame from being copied whole once more."""
    out: list[bytes] = []
    run: list[bytes] = []
    size = 0
    for p in parts:
        n = len(p)
        if run and size + n > limit:
            out.append(run[0] if len(run) == 1 else b"".join(run))
            run, size = [], 0
        if n >= limit:
            out.append(p)
            continue
        run.append(p)
        size += n
    if run:
        out.append(run[0] if len(run) == 1 else b"".join(run))
    return out


_HANDSHAKES: set[asyncio.Task[Any]] = set()  # TLS handshakes under way (kept from the GC)

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

    With a ``budget`` (Kafka's memory pool is the anchor), a big frame
    begins only once the budget grants its whole length, given back when
    the frame is handed on or the reader is released (``release``); its
    buffer still grows as above. Until then the reader is ``starved``: its
    owner stops reading and calls ``retry`` once bytes come back. A frame
    begun never needs more of the budget, so readers on one budget never
    wait for each other in a circle; frames longer than the whole budget
    are refused (set ``max_frame`` within it)."""

    SCRATCH = 256 << 10
    BIG_FRAME = 64 << 10
    FIRST_BIG = 256 << 10
    GROWTH = 4

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
            return memoryview(big)[self._big_have :]
        if not self._scratch:
            self._scratch = bytearray(self._scratch_size)
            self._view = memoryview(self._scratch)
        if self._end == len(self._scratch) and self.starved:
            # Bytes offered past the pause a starved reader asked for (no
            # loop does so): the frame is begun on credit, not refused.
            self._begin_big(force=True)
            return memoryview(cast(bytearray, self._big))[self._big_have :]
        return self._view[self._end :]

    def updated(self, n: int) -> list[bytes]:
        """``n`` bytes were written at ``get_buffer()``: the frames completed."""
        if self._big is not None:
            self._big_have += n
            if self._big_have < self._big_size:
                if self._big_have == len(self._big):
                    self._grow()
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
                self._begin_big(force=False)
                break
            else:
                break
        self.frames += len(frames)
        if self._big is not None:
            pass
        elif self._start == self._end:
            self._start = self._end = 0
        elif len(buf) - self._start < 4 + self._big_at:  # make room for a whole small frame
            rest = self._end - self._start
            buf[:rest] = view[self._start : self._end]
            self._start, self._end = 0, rest
        return frames

    def _begin_big(self, force: bool) -> None:
        """Move the big frame at the scratch's start into a buffer of its own,
        once the budget grants its length (else ``starved``)."""
        (size,) = LEN.unpack_from(self._scratch, self._start)
        if self.budget is not None:
            if size > self.budget.total:
                raise ValueError(f"frame of {size} bytes is over the link's whole budget")
            if force:
                self.budget.force(size)
            elif not self.budget.take(size):
                self.starved = True
                return
            self._held = size
        self.starved = False
        have = self._view[self._start + 4 : self._end]
        self._big = bytearray(min(size, max(self.FIRST_BIG, self.GROWTH * len(have))))
        self._big[: len(have)] = have
        self._big_have, self._big_size = len(have), size
        self._start = self._end = 0

    def _grow(self) -> None:
        """A fuller buffer for the big frame (it is full, the frame is not)."""
        old = cast(bytearray, self._big)
        new = bytearray(min(self._big_size, len(old) * self.GROWTH))
        new[: self._big_have] = memoryview(old)[: self._big_have]
        self._big = new

    def retry(self) -> bool:
        """After ``starved``: ask the budget again for the frame waiting to
        begin; True when the reader may read again."""
        if self.starved and self._big is None:
            self._begin_big(force=False)
        return not self.starved

    def _drop_big(self) -> None:
        self._big = None
        self._big_have = self._big_size = 0
        if self._held:
            held, self._held = self._held, 0
            self.budget.give(held)

    def release(self) -> None:
        """Give back what the reader holds of the budget (its link is gone)."""
        self.starved = False
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
    admitted it as its socket was accepted (``GuardedListener``), before
    any TLS, and its reader draws on the guard's budget. ``_opened`` runs
    once the link is up (after TLS, when there is TLS)."""

    KEEPALIVE: tuple[int, int, int, int]

    def __init__(
        self,
        max_frame: int,
        head_bytes: int,
        *,
        guard: LinkGuard | None = None,
        scratch: int = FrameReader.SCRATCH,
    ) -> None:
        self.transport: asyncio.Transport | None = None
        self.guard = guard
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
        self._starved = False  # not reading: waiting for the budget
        self._paused = False  # not reading: the receiver's choice (``pause``)
        self._tls = False  # a TLS transport: a frame's parts are joined (``tls_chunks``)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._open(transport)

    def _open(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._tls = transport.get_extra_info("ssl_object") is not None
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
        """The budget gave bytes back: begin the frame now, if they suffice."""
        if self.closed:
            return True  # nothing more to take for it
        if not self.reader.retry():
            return False  # it stays first in line
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
        out = [LEN.pack(sum(len(p) for p in parts)), *parts]
        self.transport.writelines(tls_chunks(out) if self._tls else out)

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


class GuardedListener:
    """A listening TCP socket whose connections a ``LinkGuard`` admits as
    they are accepted, before asyncio makes a transport of them: one over a
    cap is reset at once (no TLS handshake, no buffer); the others get
    their protocol from ``factory`` (which is handed the source address)
    and TLS with ``ssl_context`` (None: plaintext), within the guard's
    handshake time. A protocol whose handshake fails hears ``_ended``."""

    ACCEPTS_PER_WAKE = 64  # then the loop's other work before more

    def __init__(
        self,
        guard: LinkGuard,
        factory: Callable[[str], FramedConn],
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.guard = guard
        self.factory = factory
        self.ssl = ssl_context
        self.port = 0
        self._sock: socket.socket | None = None

    def start(self, host: str, port: int, backlog: int = 1024) -> int:
        """Listen on (host, port) (host "": every address; port 0: any free
        one). Returns the port; OSError if it cannot be bound."""
        h = host.strip("[]")
        if not h and socket.has_dualstack_ipv6():
            sock = socket.create_server(
                ("", port), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=True
            )
        else:
            family = socket.AF_INET6 if ":" in h else socket.AF_INET
            sock = socket.create_server((h, port), family=family, backlog=backlog)
        sock.setblocking(False)
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)
        return self.port

    def _accept(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        for _ in range(self.ACCEPTS_PER_WAKE):
            try:
                conn_sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the backlog waits
                log.warning("framed link accept failed", extra={"error": str(e)})
                return
            conn = self.factory(source_key(str(addr[0])))
            why = self.guard.admit(conn)
            if why:
                log.debug(
                    "framed link refused at accept", extra={"source": conn.source, "cap": why}
                )
                with contextlib.suppress(OSError):  # a reset: no FIN_WAIT, no TIME_WAIT
                    conn_sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                conn_sock.close()
                conn._ended(ConnectionRefusedError(why))
                continue
            conn_sock.setblocking(False)
            task = loop.create_task(
                loop.connect_accepted_socket(
                    lambda c=conn: c,  # type: ignore[misc]
                    conn_sock,
                    ssl=self.ssl,
                    ssl_handshake_timeout=self.guard.limits.handshake_s if self.ssl else None,
                )
            )
            _HANDSHAKES.add(task)
            task.add_done_callback(functools.partial(_handshake_done, conn=conn, sock=conn_sock))

    def close(self) -> None:
        """Take no more connections (those open stay: their owner closes them)."""
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None


_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s


def _handshake_done(task: asyncio.Task[Any], *, conn: FramedConn, sock: socket.socket) -> None:
    _HANDSHAKES.discard(task)
    if task.cancelled() or task.exception() is not None:
        with contextlib.suppress(OSError):
            sock.close()
        exc = None if task.cancelled() else task.exception()
        conn._ended(exc if isinstance(exc, Exception) else ConnectionError("TLS handshake failed"))
