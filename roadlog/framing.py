"""Length-prefixed frames over a byte stream, sans-I/O: a u32
little-endian length and that many bytes. Shared by roadlog's framed links
between its own processes (``roadlog.runtime.frames``) and the client SDK's
publish link (``roadlog.publish_link``)."""

from __future__ import annotations

import contextlib
import socket
import struct
from typing import Any, cast

LEN = struct.Struct("<I")


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
