"""The pipe between a node's main process and one of its worker processes,
on each side's event loop (docs/multiraft.md step 5).

It is a ``multiprocessing`` duplex pipe (an AF_UNIX socket pair) taken
over by asyncio: a message is one of the frozen dataclasses of
``pipe_messages``, encoded there (a pickle of plain values), framed by its
length. Sending never blocks the event loop (the transport buffers what the
socket does not take yet), and receiving reads only what has arrived, so
neither side's Raft loop ever waits on the other, and two processes both
sending cannot wedge each other. What is sent often and only matters as its
latest value (group 0's figures, a worker's group figures, its metrics) is
``droppable``: not sent while HIGH_WATER bytes are still waiting for the
other side, and sent again by its caller later.

Invariants: messages arrive whole and in the order sent; a message above
MAX_MESSAGE is refused where it is sent, and the pipe is closed where one
is announced, never read into memory; a frame that is not a message
(``MalformedMessage``) is logged and skipped, the next one read as usual;
only the processes of one node, which trust each other, share a pipe.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import struct
from multiprocessing.connection import Connection

from node_daemon.process.pipe_messages import (
    Barrier,
    MalformedMessage,
    Message,
    ReadBarrier,
    decode,
    encode,
)
from roadlog.errors import Code, RoadlogError

log = logging.getLogger("roadlog.node.pipe")

_LEN = struct.Struct("!I")
MAX_MESSAGE = 16 << 20
HIGH_WATER = 256 << 10


class ProcessPipe:
    """One end of the pipe; ``peer`` names the other end in the logs."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str = ""
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.peer = peer
        self.unreadable = 0  # frames skipped: not a message

    @classmethod
    async def open(cls, conn: Connection, peer: str = "") -> ProcessPipe:
        """Take ``conn`` over (it is closed; the socket stays open here)."""
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        conn.close()
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer, peer)

    def backlog(self) -> int:
        """Bytes sent but not yet taken by the socket."""
        return self._writer.transport.get_write_buffer_size()

    def send(self, msg: Message, droppable: bool = False) -> bool:
        """Queue ``msg`` (never blocks); False: not sent (droppable and the
        other side is behind, or the pipe is closed)."""
        if self._writer.is_closing() or (droppable and self.backlog() > HIGH_WATER):
            return False
        data = encode(msg)
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"a {len(data)}-byte message for the pipe (at most {MAX_MESSAGE})")
        self._writer.write(_LEN.pack(len(data)) + data)
        return True

    async def recv(self) -> Message:
        """The next message (a frame that is not one is logged and skipped);
        EOFError once the other side closed."""
        while True:
            data = await self._frame()
            try:
                return decode(data)
            except MalformedMessage as e:
                self.unreadable += 1
                log.error(
                    "a message on the pipe is not one: skipped",
                    extra={"peer": self.peer, "bytes": len(data), "error": str(e)},
                )

    async def _frame(self) -> bytes:
        try:
            (n,) = _LEN.unpack(await self._reader.readexactly(_LEN.size))
            if n > MAX_MESSAGE:
                self.close()
                raise EOFError(f"a {n}-byte message announced: the pipe is closed")
            return await self._reader.readexactly(n)
        except asyncio.IncompleteReadError:
            raise EOFError("the other process closed the pipe") from None
        except ConnectionError as e:
            raise EOFError(str(e)) from None

    def close(self) -> None:
        self._writer.close()


class BarrierAsks:
    """ReadIndexes asked of the process at the other end of a pipe: each ask
    a ``ReadBarrier`` with an id, each answer a ``Barrier`` with that id and
    an ``index`` or an ``error`` (UNAVAILABLE here)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._open: dict[int, asyncio.Future[int]] = {}

    async def ask(self, pipe: ProcessPipe | None, group: int) -> int:
        ask = next(self._ids)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._open[ask] = fut
        try:
            if pipe is None or not pipe.send(ReadBarrier(ask, group)):
                raise RoadlogError(Code.UNAVAILABLE, "the process that runs the group is gone")
            return await fut
        finally:
            self._open.pop(ask, None)

    def answered(self, msg: Barrier) -> None:
        fut = self._open.pop(msg.id, None)
        if fut is None or fut.done():
            return
        if msg.error:
            fut.set_exception(RoadlogError(Code.UNAVAILABLE, msg.error))
        else:
            fut.set_result(msg.index)

    def fail_all(self, why: str) -> None:
        """The other process died: nothing asked of it will be answered."""
        for fut in self._open.values():
            if not fut.done():
                fut.set_exception(RoadlogError(Code.UNAVAILABLE, why))
