"""The queue server's ``PublishStream`` service: PublishBatch over one
long-lived bidi stream per client, each batch matched to its answer by id.

Each batch is queued and answered exactly as a ``PublishBatch`` call with
the same bytes and deadline would be (``QueueServer.call``); answers go out
as they come, not in request order. The batches stay bytes: the queue server
reads only the envelope (id, deadline).

Invariants: every batch read from the stream is answered once while the
stream lasts; a client that half-closes gets every answer still owed before
the stream ends; an envelope that does not parse ends the stream with
INVALID_ARGUMENT (the batches already taken are still answered first).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from roadlog import round_trace
from roadlog.errors import RoadlogError
from roadlog.publish_link import PORT_METADATA
from roadlog.v1 import client_pb2

if TYPE_CHECKING:
    from queue_server.auth import Caller

SERVICE = "roadlog.v1.PublishStream"
METHOD = "PublishBatches"

# (method, request bytes, timeout s or None, caller) -> response bytes; the
# caller's credential is checked for each batch (a revoked token stops
# working on a stream that is open).
Call = Callable[[str, bytes, float | None, "Caller"], Awaitable[bytes]]
OnAnswer = Callable[[str], None]  # the answer's code name, for the metrics


async def answer_batch(
    call: Call, req: client_pb2.PublishStreamRequest, caller: Caller, on_answer: OnAnswer
) -> bytes:
    """The ``PublishStreamResponse`` bytes for ``req``: its batch answered
    as a ``PublishBatch`` call by ``caller`` with its deadline would be, or
    the refusal's code and message (on the stream and the publish link)."""
    resp = client_pb2.PublishStreamResponse(id=req.id)
    try:
        timeout = req.timeout_ms / 1000 if req.timeout_ms else None
        resp.batch = await call("PublishBatch", req.batch, timeout, caller)
        on_answer("OK")
    except RoadlogError as e:
        resp.code, resp.message = int(e.code), e.message
        on_answer(e.code.name)
    return resp.SerializeToString()


def publish_stream_handler(
    call: Call,
    caller_of: Callable[[Any], Caller],
    on_answer: OnAnswer,
    link_port: Callable[[], int] = lambda: 0,
) -> grpc.GenericRpcHandler:
    """The PublishStream service, its messages kept as bytes. ``link_port``:
    the port of this queue server's publish link now (0: none), offered to
    each stream's client in its initial metadata."""

    async def batches(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        port = link_port()
        # "Taken": the client may write; and where it may publish instead.
        await context.send_initial_metadata(((PORT_METADATA, str(port)),) if port else ())
        client = caller_of(context)
        out: asyncio.Queue[bytes | None] = asyncio.Queue()
        answering: set[asyncio.Task[None]] = set()
        bad: list[str] = []

        async def answer(req: client_pb2.PublishStreamRequest) -> None:
            out.put_nowait(await answer_batch(call, req, client, on_answer))

        async def read() -> None:
            try:
                async for raw in requests:
                    try:
                        round_trace.mark("q_req_in")
                        req = client_pb2.PublishStreamRequest.FromString(raw)
                    except DecodeError:
                        bad.append("malformed PublishStreamRequest")
                        break
                    task = asyncio.get_running_loop().create_task(answer(req))
                    answering.add(task)
                    task.add_done_callback(answering.discard)
                if answering:  # the client is done sending: answer what it sent
                    await asyncio.gather(*answering, return_exceptions=True)
            finally:
                out.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (msg := await out.get()) is not None:
                round_trace.mark("q_answer_out")
                yield msg
        finally:
            reader.cancel()
            for task in list(answering):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad[0])

    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.stream_stream_rpc_method_handler(batches)
    return grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler})
