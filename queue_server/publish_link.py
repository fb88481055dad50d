"""The queue server's end of the publish link (``roadlog.publish_link``):
clients' PublishBatch calls over framed TCP, in TLS with the queue
server's certificate (no client certificate: clients have tokens), offered
to clients in the ``PublishStream``'s initial metadata.

Each batch is admitted and queued exactly as a ``PublishBatch`` call with
the same bytes, deadline and ``authorization`` would be
(``QueueServer.client_call``: credential, scope, rate, fairness lane), and
answered as it comes, by id, as on the stream. The batches stay bytes.

Invariants: nothing but a hello (at most ``MAX_HELLO_BYTES``, within
``HANDSHAKE_TIMEOUT_S``) is read before the hello is answered; a malformed
hello, envelope or an oversized frame closes the connection (counted as
rejected), and the batches it had sent are not answered; a connection has
at most ``MAX_IN_FLIGHT`` batches unanswered and stops reading while it is
there or while the client does not read its answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable

from google.protobuf.message import DecodeError

from queue_server.auth import Caller
from queue_server.publish_stream import Call, OnAnswer, answer_batch
from roadlog import round_trace
from roadlog.framing import FramedConn
from roadlog.limits import WORK_MESSAGE_BYTES
from roadlog.publish_link import (
    HANDSHAKE_TIMEOUT_S,
    KEEPALIVE,
    MAGIC,
    MAX_HELLO_BYTES,
    decode_hello,
)
from roadlog.v1 import client_pb2

log = logging.getLogger("roadlog.queue.publish_link")

MAX_IN_FLIGHT = 256  # unanswered batches per connection before it stops reading


class PublishLinkServer:
    """Accepts publish links; ``call`` answers each batch, ``on_answer``
    hears each answer's code, ``on_reject`` each connection cut for bad
    input."""

    def __init__(
        self,
        call: Call,
        on_answer: OnAnswer,
        on_reject: Callable[[], None],
        ssl_context: ssl.SSLContext | None,
        max_frame: int = WORK_MESSAGE_BYTES,
    ) -> None:
        self.call = call
        self.on_answer = on_answer
        self.on_reject = on_reject
        self.ssl = ssl_context
        self.max_frame = max_frame
        self.port = 0
        self.connections: set[_Served] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on (host, port), 0: any free port. Returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Served(self),
            host.strip("[]") or None,
            port,
            ssl=self.ssl,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if self.ssl is not None else None,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def offer(self, host: str, port: int) -> int:
        """``start``, but a port that cannot be bound is a warning: returns
        0, and clients publish over gRPC."""
        try:
            bound = await self.start(host, port)
        except OSError as e:
            log.warning(
                "publish link off: cannot bind its port; clients publish over gRPC",
                extra={"port": port, "error": str(e)},
            )
            return 0
        log.info("publish link listening", extra={"port": bound})
        return bound

    async def close(self, grace: float = 0.0) -> None:
        """Take no more connections; let the batches taken be answered for
        up to ``grace`` seconds, then cut every link (a client sends what
        is still unanswered again, elsewhere)."""
        if self._server is None:
            return
        self._server.close()
        deadline = asyncio.get_running_loop().time() + grace
        while any(c.answering for c in self.connections):
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.02)
        for c in list(self.connections):
            c.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2.0)


class _Served(FramedConn):
    """One client's link."""

    KEEPALIVE = KEEPALIVE

    def __init__(self, server: PublishLinkServer) -> None:
        super().__init__(MAX_HELLO_BYTES, head_bytes=0)  # until the hello is answered
        self.server = server
        self.caller: Caller | None = None
        self.answering: set[asyncio.Task[None]] = set()
        self._reading = True
        self._hello_timer: asyncio.TimerHandle | None = None
        self._source = ""  # the client's host

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)
        peer = transport.get_extra_info("peername")
        self._source = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.on_frame = self._hello
        self._hello_timer = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT_S, self.refuse, "no hello in time"
        )
        assert self.transport is not None
        self.transport.write(MAGIC)

    def _hello(self, frame: bytes) -> None:
        declared, credential = decode_hello(frame)  # ValueError: refused
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.caller = Caller(credential, self._source, declared)
        self.reader.max_frame = self.server.max_frame
        self.on_frame = self._request
        self.write_parts([b""])

    def _request(self, frame: bytes) -> None:
        round_trace.mark("q_req_in")
        try:
            req = client_pb2.PublishStreamRequest.FromString(frame)
        except DecodeError:
            raise ValueError("malformed PublishStreamRequest") from None
        task = asyncio.get_running_loop().create_task(self._answer(req))
        self.answering.add(task)
        task.add_done_callback(self._answered)
        self._pace()

    async def _answer(self, req: client_pb2.PublishStreamRequest) -> None:
        assert self.caller is not None
        resp = await answer_batch(self.server.call, req, self.caller, self.server.on_answer)
        if not self.closed:
            round_trace.mark("q_answer_out")
            self.write_parts([resp])
            self._pace()

    def _answered(self, task: asyncio.Task[None]) -> None:
        self.answering.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("publish link answer failed", exc_info=task.exception())
        self._pace()

    def _pace(self) -> None:
        """Read while few batches wait and the client takes its answers."""
        if self.transport is None or self.closed:
            return
        keep = len(self.answering) < MAX_IN_FLIGHT and self.can_write.is_set()
        if keep != self._reading:
            self._reading = keep
            if keep:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._pace()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._pace()

    def refuse(self, why: str) -> None:
        if not self.closed:
            self.server.on_reject()
            log.warning("publish link cut", extra={"source": self._source, "why": why})
        self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        for task in list(self.answering):
            task.cancel()
        self.server.connections.discard(self)
        super().connection_lost(exc)
