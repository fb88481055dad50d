"""The queue server's end of the publish link (``roadlog.publish_link``):
clients' PublishBatch calls over framed TCP, in TLS with the queue
server's certificate (no client certificate: clients have tokens), offered
to clients in the ``PublishStream``'s initial metadata.

Each batch is admitted and queued exactly as a ``PublishBatch`` call with
the same bytes, deadline and ``authorization`` would be
(``QueueServer.client_call``: credential, scope, rate, fairness lane), and
answered as it comes, by id, as on the stream. The batches stay bytes.

The hello's credential is checked before anything else is read
(``authenticate``, as every call's): a hello without a good one is answered
with the reason (a frame that is not empty) and the link closed, so a
stranger never gets past the hello; batches on an open link are still each
admitted on their own, so a token revoked meanwhile stops working at the
next batch.

What anyone may hold here is bounded (``LIMITS``, kept by a
``roadlog.link_limits.LinkGuard``): connections in all and per source
address, counted before TLS; strangers (not past their hello) read into a
buffer of the hello's size only, within ``HANDSHAKE_TIMEOUT_S`` of the
accept; partial frames of every link together within one byte budget; a
frame begun must arrive within its deadline, and a link idle for
``idle_s`` is closed.

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
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError

from queue_server.auth import Caller
from queue_server.publish_stream import Call, OnAnswer, answer_batch
from roadlog import round_trace
from roadlog.errors import RoadlogError
from roadlog.framing import FramedConn, FrameReader, GuardedListener
from roadlog.limits import WORK_MESSAGE_BYTES
from roadlog.link_limits import LinkGuard, LinkLimits
from roadlog.publish_link import (
    HANDSHAKE_TIMEOUT_S,
    KEEPALIVE,
    MAGIC,
    MAX_HELLO_BYTES,
    decode_hello,
)
from roadlog.runtime.frames import LINKS_CUT
from roadlog.v1 import client_pb2

log = logging.getLogger("roadlog.queue.publish_link")

MAX_IN_FLIGHT = 256  # unanswered batches per connection before it stops reading

# Who may hold what on the publish link's port (roadlog.link_limits). Phones
# behind a carrier's NAT share an address, and a benchmark's publishers
# dial at once from one: the per-source caps are wide; the stranger caps
# bound what the credential-less can hold (each one a TLS handshake's state
# and a hello's buffer) and the budget what partial frames hold.
LIMITS = LinkLimits(
    max_links=4096,
    max_links_per_source=1024,
    max_strangers=256,
    max_strangers_per_source=64,
    handshake_s=HANDSHAKE_TIMEOUT_S,
    idle_s=300.0,
    frame_s=10.0,
    min_rate=64 << 10,
    buffer_bytes=256 << 20,
)

# Checks a hello's credential: the identity (anything) or RoadlogError.
Authenticate = Callable[[Caller], Awaitable[object]]


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
        authenticate: Authenticate | None = None,
        limits: LinkLimits = LIMITS,
    ) -> None:
        """``authenticate``: checks each hello's credential before anything
        more is read (None: every hello is taken, each batch still admitted
        on its own)."""
        self.call = call
        self.on_answer = on_answer
        self.on_reject = on_reject
        self.ssl = ssl_context
        self.max_frame = max_frame
        self.authenticate = authenticate
        if max_frame > limits.buffer_bytes:
            raise ValueError("publish link: a frame may not be longer than the budget")
        self.guard = LinkGuard(limits, lambda why: LINKS_CUT.labels("publish", why).inc())
        self._listener = GuardedListener(
            self.guard, lambda source: _Served(self, source), ssl_context
        )
        self.port = 0
        self.connections: set[_Served] = set()  # up (past TLS), until they end
        self._listening = False

    def _served(self, source: str) -> _Served:
        return _Served(self, source)

    async def start(self, host: str, port: int) -> int:
        """Listen on (host, port), 0: any free port. Returns the port."""
        self.port = self._listener.start(host, port)
        self._listening = True
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
        if not self._listening:
            return
        self._listening = False
        self._listener.close()
        deadline = asyncio.get_running_loop().time() + grace
        while any(c.answering for c in self.connections):
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.02)
        for c in list(self.connections):
            c.abort()


class _Served(FramedConn):
    """One client's link."""

    KEEPALIVE = KEEPALIVE

    def __init__(self, server: PublishLinkServer, source: str) -> None:
        # Until the hello is answered: a hello's worth of buffer, no budget drawn.
        super().__init__(
            MAX_HELLO_BYTES, head_bytes=0, guard=server.guard, scratch=MAX_HELLO_BYTES + 4
        )
        self.server = server
        self.source = source
        self.caller: Caller | None = None
        self.answering: set[asyncio.Task[None]] = set()
        self._hello_timer: asyncio.TimerHandle | None = None
        self._checking: asyncio.Task[None] | None = None
        self._early: list[bytes] = []  # frames that came with the hello

    def _opened(self) -> None:
        self.server.connections.add(self)
        self.on_frame = self._hello
        self._hello_timer = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT_S, self.refuse, "no hello in time"
        )
        assert self.transport is not None
        self.transport.write(MAGIC)

    def _hello(self, frame: bytes) -> None:
        declared, credential = decode_hello(frame)  # ValueError: refused
        self.caller = Caller(credential, self.source, declared)
        self.on_frame = self._after_hello
        self.pause(True)  # nothing more is read until the credential checks out
        self._checking = asyncio.get_running_loop().create_task(self._check_hello())

    def _after_hello(self, frame: bytes) -> None:
        """A frame sent with the hello, before its answer: kept for after it
        (what fits the hello's buffer, a few KiB), dropped if it is refused."""
        self._early.append(frame)

    async def _check_hello(self) -> None:
        assert self.caller is not None
        if self.server.authenticate is not None:
            try:
                await self.server.authenticate(self.caller)
            except RoadlogError as e:
                self._refuse_hello(f"{e.code.name}: {e.message}")
                return
            except Exception as e:  # the cluster could not say: the client tries gRPC
                self._refuse_hello(f"UNAVAILABLE: the credential could not be checked ({e})")
                return
        if self.closed:
            return
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.known()
        self.on_frame = self._request
        self.write_parts([b""])
        early, self._early = self._early, []
        try:
            self.deliver(early + self.reader.widen(self.server.max_frame, FrameReader.SCRATCH))
        except Exception as e:
            self.refuse(str(e) or type(e).__name__)
            return
        self.pause(False)
        self._pace()

    def _refuse_hello(self, why: str) -> None:
        """Tell the client why (a frame that is not empty), then close."""
        if self.closed:
            return
        self.server.on_reject()
        log.info("publish link hello refused", extra={"source": self.source, "why": why})
        with contextlib.suppress(ConnectionError):
            self.write_parts([why.encode()[:512]])
        assert self.transport is not None
        self.transport.close()  # what was written goes out first
        self._ended(ConnectionError("hello refused"))

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
        if self.transport is None or self.closed or not self.authenticated:
            return
        keep = len(self.answering) < MAX_IN_FLIGHT and self.can_write.is_set()
        if keep == self._paused:
            self.pause(not keep)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._pace()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._pace()

    def refuse(self, why: str) -> None:
        if not self.closed:
            self.server.on_reject()
            log.warning("publish link cut", extra={"source": self.source, "why": why})
        self.abort()

    def _ended(self, exc: Exception | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self._checking is not None and self._checking is not asyncio.current_task():
            self._checking.cancel()
        for task in list(self.answering):
            task.cancel()
        self.server.connections.discard(self)
        super()._ended(exc)
