"""PublishBatch over one long-lived ``PublishStream`` to one queue server.

A client that publishes all the time pays a stream message per batch
instead of a gRPC call's setup (headers, a call object, its deadline timer)
on both ends. Batches are matched to their answers by id, so many are out
at once and answers may come in any order.

Invariants: ``exchange`` returns the PublishBatchResponse bytes or raises
``BatchFailed`` with the status the same unary call would have had; a
broken stream fails every batch waiting on it with UNAVAILABLE (retryable:
the publisher sends them again) and the next batch opens a new stream; a
queue server without the service (UNIMPLEMENTED) is called unary from then
on, the batch that found out included.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import grpc

from roadlog import round_trace
from roadlog.errors import Code
from roadlog.grpc_status import from_grpc
from roadlog.v1 import client_pb2

STREAM_METHOD = "/roadlog.v1.PublishStream/PublishBatches"
UNARY_METHOD = "/roadlog.v1.Roadlog/PublishBatch"
ANSWER_GRACE_S = 1.0  # the server answers before the deadline; this is its slack


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

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self._open_stream: Any = channel.stream_stream(STREAM_METHOD)  # bytes both ways
        self._unary: Any = channel.unary_unary(UNARY_METHOD)
        self.metadata = metadata
        self.unary_only = False
        self._open: _Open | None = None
        self._readers: set[asyncio.Task[None]] = set()
        self._waiting: dict[int, asyncio.Future[client_pb2.PublishStreamResponse]] = {}
        self._ids = itertools.count(1)
        self._write = asyncio.Lock()  # one write at a time on a stream

    async def exchange(self, batch: bytes, timeout: float) -> bytes:
        """One serialized PublishBatchRequest in, its response's bytes out."""
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
        await op.call.initial_metadata()
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

    async def _streamed(self, batch: bytes, timeout: float) -> bytes:
        op = await self._stream(timeout)
        rid = next(self._ids)
        fut: asyncio.Future[client_pb2.PublishStreamResponse] = (
            asyncio.get_running_loop().create_future()
        )
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # may go unread
        self._waiting[rid] = fut
        req = client_pb2.PublishStreamRequest(
            id=rid, timeout_ms=max(int(timeout * 1000), 1), batch=batch
        )
        try:
            try:
                async with self._write:
                    round_trace.mark("c_write")
                    await op.call.write(req.SerializeToString())
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
        if resp.code:
            code = Code.of(resp.code)
            raise BatchFailed(code, resp.message or code.name)
        return resp.batch

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
        if self._open is not None:
            self._broken(self._open, BatchFailed(Code.UNAVAILABLE, "the publisher closed"))
        for reader in list(self._readers):
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
