"""PublishBatch over one long-lived ``PublishStream`` to one queue server.

A client that publishes all the time pays a stream message per batch
instead of a gRPC call's setup (headers, a call object, its deadline timer)
on both ends. Batches are matched to their answers by id, so many are out
at once and answers may come in any order.

Where the queue server offers its publish link (``roadlog.publish_link``:
its port in the stream's initial metadata) and a ``dial`` is given, the
batches go over that framed link as soon as it is up, and over the stream
while it is not: the two gRPC hops of a round were 0.42 ms of a 4.3 ms
round at 100 pings a message (bench/profiles/write-path.md, session 25).

Invariants: ``exchange`` returns the PublishBatchResponse bytes or raises
``BatchFailed`` with the status the same unary call would have had; a
broken stream or link fails every batch waiting on it with UNAVAILABLE
(retryable: the publisher sends them again) and the next batch opens a new
stream (and, ``LINK_RETRY_S`` later, dials the link again); a queue server
without the service (UNIMPLEMENTED) is called unary from then on, the batch
that found out included.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from roadlog import round_trace
from roadlog.errors import Code
from roadlog.framing import OnFrame
from roadlog.grpc_status import from_grpc
from roadlog.publish_link import PORT_METADATA, PublishLink
from roadlog.v1 import client_pb2

STREAM_METHOD = "/roadlog.v1.PublishStream/PublishBatches"
UNARY_METHOD = "/roadlog.v1.Roadlog/PublishBatch"
ANSWER_GRACE_S = 1.0  # the server answers before the deadline; this is its slack
LINK_RETRY_S = 2.0  # after a publish link broke, or first failed to open, before dialling again
LINK_RETRY_MAX_S = 60.0  # failed dials back off, doubling up to this (a port a firewall drops)

# Dials a queue server's publish link on that port; its answers go to the OnFrame.
Dial = Callable[[int, OnFrame], Awaitable[PublishLink]]


class BatchFailed(Exception):
    def __init__(self, code: Code, why: str) -> None:
        super().__init__(why)
        self.code = code
        self.why = why


class _Unimplemented(Exception):
    pass


class _Open:
    """One stream call, and how it ended (set by its reader)."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.ended: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
        self.ready: asyncio.Task[None] | None = None  # the server's first word came


class BatchStream:
    """Batches to one queue server, over a stream (reopened when it breaks)
    or unary calls where the server offers no stream."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        metadata: tuple[tuple[str, str], ...],
        dial: Dial | None = None,
    ) -> None:
        """``dial``: how to open the queue server's publish link where it
        offers one (None: the stream only)."""
        self._open_stream: Any = channel.stream_stream(STREAM_METHOD)  # bytes both ways
        self._unary: Any = channel.unary_unary(UNARY_METHOD)
        self.metadata = metadata
        self.unary_only = False
        self._dial = dial
        self._link: PublishLink | None = None
        self._link_port = 0  # offered by the queue server (0: none)
        self._dialing: asyncio.Task[None] | None = None
        self._dial_after = 0.0  # monotonic
        self._dial_failures = 0  # in a row
        self._link_waiting: dict[int, asyncio.Future[client_pb2.PublishStreamResponse]] = {}
        self.linked = 0  # batches answered over the publish link
        self._open: _Open | None = None
        self._readers: set[asyncio.Task[None]] = set()
        self._waiting: dict[int, asyncio.Future[client_pb2.PublishStreamResponse]] = {}
        self._ids = itertools.count(1)
        self._write = asyncio.Lock()  # one write at a time on a stream

    async def exchange(self, batch: bytes, timeout: float) -> bytes:
        """One serialized PublishBatchRequest in, its response's bytes out."""
        link = self._link
        if link is not None and not link.closed:
            return await self._linked(link, batch, timeout)
        self._maybe_dial()
        if not self.unary_only:
            try:
                return await self._streamed(batch, timeout)
            except _Unimplemented:
                self.unary_only = True
        try:
            raw: bytes = await self._unary(batch, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            code = from_grpc(e.code())
            raise BatchFailed(code, e.details() or code.name) from None
        return raw

    async def _stream(self, timeout: float) -> _Open:
        """The open stream, once the server has said it takes it (its
        initial metadata): a server without the service says UNIMPLEMENTED
        then, before any batch is written (a write racing that answer can
        end the call with an INTERNAL status instead)."""
        if self._open is None:
            op = self._open = _Open(self._open_stream(metadata=self.metadata))
            op.ready = asyncio.get_running_loop().create_task(self._handshake(op))
            op.ready.add_done_callback(lambda t: t.cancelled() or t.exception())
        op = self._open
        assert op.ready is not None
        try:
            await asyncio.wait_for(asyncio.shield(op.ready), timeout)
        except TimeoutError:
            raise BatchFailed(Code.DEADLINE_EXCEEDED, "no answer before the deadline") from None
        return op

    async def _handshake(self, op: _Open) -> None:
        for key, value in await op.call.initial_metadata() or ():
            if key == PORT_METADATA and str(value).isdigit():
                self._link_port = int(value)
        if op.call.done():
            code = await op.call.code()
            failure: Exception
            if code == grpc.StatusCode.UNIMPLEMENTED:
                failure = _Unimplemented()
            else:
                why = await op.call.details() or code.name
                failure = BatchFailed(Code.UNAVAILABLE, f"publish stream refused: {why}")
            op.ended.set_result(failure)
            self._broken(op, failure)
            raise failure
        reader = asyncio.get_running_loop().create_task(self._read(op))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)

    def _request(
        self,
        batch: bytes,
        timeout: float,
        waiting: dict[int, asyncio.Future[client_pb2.PublishStreamResponse]],
    ) -> tuple[int, asyncio.Future[client_pb2.PublishStreamResponse], bytes]:
        """A new id, the future its answer will set (kept in ``waiting``),
        and the serialized request that carries ``batch``."""
        rid = next(self._ids)
        fut: asyncio.Future[client_pb2.PublishStreamResponse] = (
            asyncio.get_running_loop().create_future()
        )
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # may go unread
        waiting[rid] = fut
        req = client_pb2.PublishStreamRequest(
            id=rid, timeout_ms=max(int(timeout * 1000), 1), batch=batch
        )
        return rid, fut, req.SerializeToString()

    @staticmethod
    def _batch_of(resp: client_pb2.PublishStreamResponse) -> bytes:
        """The answer's PublishBatchResponse bytes, or its failure raised."""
        if resp.code:
            code = Code.of(resp.code)
            raise BatchFailed(code, resp.message or code.name)
        return resp.batch

    async def _streamed(self, batch: bytes, timeout: float) -> bytes:
        op = await self._stream(timeout)
        rid, fut, req = self._request(batch, timeout, self._waiting)
        try:
            try:
                async with self._write:
                    round_trace.mark("c_write")
                    await op.call.write(req)
            except Exception as e:  # the stream is gone: its reader says why
                try:
                    failure = await asyncio.wait_for(asyncio.shield(op.ended), ANSWER_GRACE_S)
                except TimeoutError:
                    failure = BatchFailed(Code.UNAVAILABLE, f"publish stream broke: {e!r}")
                self._broken(op, failure)
                raise failure from None
            try:
                resp = await asyncio.wait_for(fut, timeout + ANSWER_GRACE_S)
            except TimeoutError:
                raise BatchFailed(Code.DEADLINE_EXCEEDED, "no answer before the deadline") from None
        finally:
            self._waiting.pop(rid, None)
        return self._batch_of(resp)

    # -- the publish link ----------------------------------------------------

    def _maybe_dial(self) -> None:
        """Dial the offered publish link in the background (the batch at
        hand goes over the stream), unless a dial is under way or failed
        less than LINK_RETRY_S ago."""
        if (
            self._dial is None
            or not self._link_port
            or (self._dialing is not None and not self._dialing.done())
            or time.monotonic() < self._dial_after
        ):
            return
        self._dialing = asyncio.get_running_loop().create_task(self._open_link(self._link_port))

    async def _open_link(self, port: int) -> None:
        assert self._dial is not None
        try:
            link = await self._dial(port, self._link_answer)
        except Exception:  # none there, refused, not one: the stream serves
            wait = min(LINK_RETRY_S * 2**self._dial_failures, LINK_RETRY_MAX_S)
            self._dial_failures += 1
            self._dial_after = time.monotonic() + wait
            return
        self._dial_failures = 0
        link.lost.add_done_callback(lambda _: self._link_down(link))
        self._link = link

    def _link_answer(self, raw: bytes) -> None:
        round_trace.mark("c_answer_in")
        resp = client_pb2.PublishStreamResponse.FromString(raw)  # bad: the link closes
        fut = self._link_waiting.pop(resp.id, None)
        if fut is not None and not fut.done():
            fut.set_result(resp)

    def _link_down(self, link: PublishLink) -> None:
        if self._link is link:
            self._link = None
            self._dial_after = time.monotonic() + LINK_RETRY_S
        failure = BatchFailed(Code.UNAVAILABLE, "the publish link broke")
        for fut in self._link_waiting.values():
            if not fut.done():
                fut.set_exception(failure)
        self._link_waiting.clear()

    async def _linked(self, link: PublishLink, batch: bytes, timeout: float) -> bytes:
        rid, fut, req = self._request(batch, timeout, self._link_waiting)
        try:
            round_trace.mark("c_write")
            await link.send(req)
            resp = await asyncio.wait_for(fut, timeout + ANSWER_GRACE_S)
        except ConnectionError:
            raise BatchFailed(Code.UNAVAILABLE, "the publish link broke") from None
        except TimeoutError:
            raise BatchFailed(Code.DEADLINE_EXCEEDED, "no answer before the deadline") from None
        finally:
            self._link_waiting.pop(rid, None)
        self.linked += 1
        return self._batch_of(resp)

    async def _read(self, op: _Open) -> None:
        failure: Exception = BatchFailed(Code.UNAVAILABLE, "the publish stream ended")
        try:
            async for raw in op.call:
                round_trace.mark("c_answer_in")
                resp = client_pb2.PublishStreamResponse.FromString(raw)
                fut = self._waiting.pop(resp.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(resp)
        except asyncio.CancelledError:
            failure = BatchFailed(Code.UNAVAILABLE, "the publish stream was closed")
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                failure = _Unimplemented()
            else:
                why = e.details() or e.code().name
                failure = BatchFailed(Code.UNAVAILABLE, f"publish stream broke: {why}")
        except Exception as e:  # a malformed answer: drop the stream, start over
            failure = BatchFailed(Code.UNAVAILABLE, f"publish stream broke: {e!r}")
        finally:
            if not op.ended.done():
                op.ended.set_result(failure)
            self._broken(op, failure)

    def _broken(self, op: _Open, failure: Exception) -> None:
        """The stream ``op`` is over: fail what waits on it; the next batch
        opens a new one."""
        if self._open is not op:
            return
        self._open = None
        with contextlib.suppress(Exception):
            op.call.cancel()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(failure)
        self._waiting.clear()

    async def close(self) -> None:
        if self._dialing is not None:
            self._dialing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._dialing
        if self._link is not None:
            self._link.abort()
        if self._open is not None:
            self._broken(self._open, BatchFailed(Code.UNAVAILABLE, "the publisher closed"))
        for reader in list(self._readers):
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
