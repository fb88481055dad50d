"""The queue server's PublishStream handler on a real gRPC server: each batch
answered once by id, out of order when its work finishes sooner, with the
status a PublishBatch call would have had; everything owed answered after
the client half-closes; a malformed envelope ends the stream after the
batches already taken are answered."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from queue_server.auth import Caller
from queue_server.publish_stream import METHOD, SERVICE, publish_stream_handler
from roadlog.errors import Code, RoadlogError
from roadlog.runtime.processes import free_port
from roadlog.v1 import client_pb2

pytestmark = pytest.mark.unit


async def _serve(
    delays: dict[bytes, float], answered: list[str]
) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    async def call(method: str, body: bytes, timeout: float | None, caller: Caller) -> bytes:
        client = caller.declared
        assert method == "PublishBatch"
        await asyncio.sleep(delays.get(body, 0.0))
        if body == b"refuse":
            raise RoadlogError(Code.RESOURCE_EXHAUSTED, "queue full")
        return b"answer:" + body + b":" + client.encode() + b":%d" % int((timeout or 0) * 1000)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (publish_stream_handler(call, lambda ctx: Caller(None, "", "client-7"), answered.append),)
    )
    addr = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(addr)
    await server.start()
    return server, grpc.aio.insecure_channel(addr)


def _req(rid: int, body: bytes, timeout_ms: int = 0) -> bytes:
    return client_pb2.PublishStreamRequest(
        id=rid, batch=body, timeout_ms=timeout_ms
    ).SerializeToString()


def test_answers_come_by_id_as_work_finishes_and_all_are_owed_after_half_close() -> None:
    async def run() -> tuple[list[client_pb2.PublishStreamResponse], list[str]]:
        answered: list[str] = []
        server, ch = await _serve({b"slow": 0.3}, answered)
        try:
            call: Any = ch.stream_stream(f"/{SERVICE}/{METHOD}")()
            await call.write(_req(1, b"slow", 5000))
            await call.write(_req(2, b"fast"))
            await call.write(_req(3, b"refuse"))
            await call.done_writing()  # half-close: the slow one is still owed
            got = [client_pb2.PublishStreamResponse.FromString(m) async for m in call]
            assert await call.code() == grpc.StatusCode.OK
            return got, answered
        finally:
            await ch.close()
            await server.stop(None)

    got, answered = asyncio.run(run())
    assert [r.id for r in got] == [2, 3, 1]  # as the work finished
    assert got[0].code == 0 and got[0].batch == b"answer:fast:client-7:0"
    assert got[1].code == Code.RESOURCE_EXHAUSTED and got[1].message == "queue full"
    assert not got[1].batch
    assert got[2].code == 0 and got[2].batch == b"answer:slow:client-7:5000"
    assert sorted(answered) == ["OK", "OK", "RESOURCE_EXHAUSTED"]


def test_a_malformed_envelope_ends_the_stream_after_answering_what_was_taken() -> None:
    async def run() -> tuple[list[client_pb2.PublishStreamResponse], grpc.StatusCode, str]:
        server, ch = await _serve({b"slow": 0.2}, [])
        try:
            call: Any = ch.stream_stream(f"/{SERVICE}/{METHOD}")()
            await call.write(_req(1, b"slow"))
            await call.write(b"\xff\xff\xff")  # not a PublishStreamRequest
            got: list[client_pb2.PublishStreamResponse] = []
            with pytest.raises(grpc.aio.AioRpcError):  # the stream's end status
                async for m in call:
                    got.append(client_pb2.PublishStreamResponse.FromString(m))
            return got, await call.code(), await call.details()
        finally:
            await ch.close()
            await server.stop(None)

    got, code, details = asyncio.run(run())
    assert [(r.id, r.batch) for r in got] == [(1, b"answer:slow:client-7:0")]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in details
