"""The pipe between a node's main process and one of its worker processes,
on each side's event loop (docs/multiraft.md step 5).

It is a ``multiprocessing`` duplex pipe (an AF_UNIX socket pair) taken
over by asyncio: a message is a picklable dict, framed by its length.
Sending never blocks the event loop (the transport buffers what the socket
does not take yet), and receiving reads only what has arrived, so neither
side's Raft loop ever waits on the other, and two processes both sending
cannot wedge each other. What is sent often and only matters as its latest
value (group 0's figures, a worker's group figures, its metrics) is
``droppable``: not sent while HIGH_WATER bytes are still waiting for the
other side, and sent again by its caller later.

Invariants: messages arrive whole and in the order sent; a message above
MAX_MESSAGE is refused where it is sent, and the pipe is closed where one
is announced, never read into memory; only the processes of one node, which
trust each other, share a pipe (pickle).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import socket
import struct
from multiprocessing.connection import Connection
from typing import Any

from roadlog.errors import Code, RoadlogError

_LEN = struct.Struct("!I")
MAX_MESSAGE = 16 << 20
HIGH_WATER = 256 << 10


class ProcessPipe:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, conn: Connection) -> ProcessPipe:
        """Take ``conn`` over (it is closed; the socket stays open here)."""
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        conn.close()
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    def backlog(self) -> int:
        """Bytes sent but not yet taken by the socket."""
        return self._writer.transport.get_write_buffer_size()

    def send(self, msg: dict[str, Any], droppable: bool = False) -> bool:
        """Queue ``msg`` (never blocks); False: not sent (droppable and the
        other side is behind, or the pipe is closed)."""
        if self._writer.is_closing() or (droppable and self.backlog() > HIGH_WATER):
            return False
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"a {len(data)}-byte message for the pipe (at most {MAX_MESSAGE})")
        self._writer.write(_LEN.pack(len(data)) + data)
        return True

    async def recv(self) -> dict[str, Any]:
        """The next message; EOFError once the other side closed."""
        try:
            (n,) = _LEN.unpack(await self._reader.readexactly(_LEN.size))
            if n > MAX_MESSAGE:
                self.close()
                raise EOFError(f"a {n}-byte message announced: the pipe is closed")
            msg = pickle.loads(await self._reader.readexactly(n))
        except asyncio.IncompleteReadError:
            raise EOFError("the other process closed the pipe") from None
        except ConnectionError as e:
            raise EOFError(str(e)) from None
        if not isinstance(msg, dict):
            raise EOFError("not a message")
        return msg

    def close(self) -> None:
        self._writer.close()


class BarrierAsks:
    """ReadIndexes asked of the process at the other end of a pipe: each ask
    a "read_barrier" message with an id, each answer a "barrier" message
    with that id and an ``index`` or an ``error`` (UNAVAILABLE here)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._open: dict[int, asyncio.Future[int]] = {}

    async def ask(self, pipe: ProcessPipe | None, group: int) -> int:
        ask = next(self._ids)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._open[ask] = fut
        try:
            if pipe is None or not pipe.send({"kind": "read_barrier", "id": ask, "group": group}):
                raise RoadlogError(Code.UNAVAILABLE, "the process that runs the group is gone")
            return await fut
        finally:
            self._open.pop(ask, None)

    def answered(self, msg: dict[str, Any]) -> None:
        fut = self._open.pop(int(msg["id"]), None)
        if fut is None or fut.done():
            return
        if "index" in msg:
            fut.set_result(int(msg["index"]))
        else:
            fut.set_exception(RoadlogError(Code.UNAVAILABLE, str(msg.get("error"))))

    def fail_all(self, why: str) -> None:
        """The other process died: nothing asked of it will be answered."""
        for fut in self._open.values():
            if not fut.done():
                fut.set_exception(RoadlogError(Code.UNAVAILABLE, why))
