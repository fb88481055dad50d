"""The publish link's wire, spoken by hand to a real PublishLinkServer on
loopback: the greeting, the hello (its limit, its deadline, its answer),
batches answered by id with the caller the hello named, refusals as
codes, and bad input cutting the connection (counted)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable

import pytest

from queue_server import publish_link as server_link
from queue_server.auth import Caller
from queue_server.publish_link import PublishLinkServer
from roadlog.errors import Code, RoadlogError
from roadlog.framing import LEN
from roadlog.publish_link import (
    KEEPALIVE_COUNT,
    KEEPALIVE_IDLE_S,
    KEEPALIVE_INTERVAL_S,
    MAGIC,
    MAX_HELLO_BYTES,
    USER_TIMEOUT_MS,
    decode_hello,
    encode_hello,
    open_link,
)
from roadlog.v1 import client_pb2

pytestmark = pytest.mark.unit


def test_a_hello_says_the_client_and_its_credential() -> None:
    assert decode_hello(encode_hello("phone-7", "Bearer rl_x")) == ("phone-7", "Bearer rl_x")
    assert decode_hello(encode_hello("", None)) == ("", None)
    assert decode_hello(encode_hello("c" * 500, None))[0] == "c" * 128  # cut to its limit
    with pytest.raises(ValueError):
        encode_hello("c", "Bearer " + "x" * MAX_HELLO_BYTES)


@pytest.mark.parametrize(
    "frame",
    [
        b"\x01",  # shorter than its head
        struct.pack("<HH", 3, 0) + b"ab",  # lengths that do not add up
        struct.pack("<HH", 200, 0) + b"x" * 200,  # a client id over its limit
        struct.pack("<HH", 2, 0) + b"\xff\xfe",  # not UTF-8
    ],
)
def test_a_malformed_hello_is_refused(frame: bytes) -> None:
    with pytest.raises(ValueError):
        decode_hello(frame)


class Link:
    """A server on loopback whose batches ``answer`` answers, with the
    callers and answer codes it saw."""

    def __init__(self, answer: Callable[[bytes, float | None], Awaitable[bytes]]) -> None:
        self.callers: list[Caller] = []
        self.codes: list[str] = []
        self.rejected = 0
        self.answer = answer

    async def call(self, method: str, body: bytes, timeout: float | None, who: Caller) -> bytes:
        assert method == "PublishBatch"
        self.callers.append(who)
        return await self.answer(body, timeout)

    async def start(self) -> PublishLinkServer:
        def reject() -> None:
            self.rejected += 1

        s = PublishLinkServer(self.call, self.codes.append, reject, None)
        await s.start("127.0.0.1", 0)
        return s


def frame(payload: bytes) -> bytes:
    return LEN.pack(len(payload)) + payload


async def read_frame(r: asyncio.StreamReader) -> bytes:
    (n,) = LEN.unpack(await asyncio.wait_for(r.readexactly(4), 5))
    return await asyncio.wait_for(r.readexactly(n), 5)


async def closed(r: asyncio.StreamReader) -> bool:
    """The server closed the connection (reads end)."""
    try:
        return await asyncio.wait_for(r.read(), 5) == b""
    except ConnectionResetError:
        return True


def request(rid: int, batch: bytes, timeout_ms: int = 1000) -> bytes:
    return client_pb2.PublishStreamRequest(
        id=rid, timeout_ms=timeout_ms, batch=batch
    ).SerializeToString()


def test_batches_are_answered_by_id_as_the_hello_said_who_asks() -> None:
    async def answer(body: bytes, timeout: float | None) -> bytes:
        if body == b"refuse":
            raise RoadlogError(Code.PERMISSION_DENIED, "no produce scope")
        await asyncio.sleep(0.05 if body == b"slow" else 0)
        assert timeout == 1.0
        return b"ok:" + body

    async def run() -> None:
        link = Link(answer)
        server = await link.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            assert await asyncio.wait_for(r.readexactly(len(MAGIC)), 5) == MAGIC
            w.write(frame(encode_hello("phone-7", "Bearer rl_abc")))
            assert await read_frame(r) == b""  # the hello's answer
            w.write(frame(request(1, b"slow")) + frame(request(2, b"fast")))
            w.write(frame(request(3, b"refuse")))
            got = {}
            for _ in range(3):
                resp = client_pb2.PublishStreamResponse.FromString(await read_frame(r))
                got[resp.id] = resp
            assert got[1].batch == b"ok:slow" and got[2].batch == b"ok:fast"
            assert got[3].code == int(Code.PERMISSION_DENIED)
            assert got[3].message == "no produce scope"
            assert link.callers == [Caller("Bearer rl_abc", "127.0.0.1", "phone-7")] * 3
            assert sorted(link.codes) == ["OK", "OK", "PERMISSION_DENIED"]
            w.close()
        finally:
            await server.close()
        assert link.rejected == 0

    asyncio.run(run())


@pytest.mark.parametrize(
    "first",
    [
        frame(b"x" * (MAX_HELLO_BYTES + 1)),  # a hello over its limit
        frame(b"\x01"),  # not a hello
        frame(encode_hello("c", None)) + frame(b"y" * (MAX_HELLO_BYTES + 1)),  # too soon, too big
    ],
    ids=["hello-too-big", "not-a-hello", "big-frame-before-the-answer"],
)
def test_bad_input_before_the_hello_is_answered_cuts_the_link(first: bytes) -> None:
    async def answer(body: bytes, timeout: float | None) -> bytes:
        raise AssertionError("nothing may be answered")

    async def run() -> int:
        link = Link(answer)
        server = await link.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            await asyncio.wait_for(r.readexactly(len(MAGIC)), 5)
            w.write(first)
            try:  # at most the hello's answer, then EOF (or a reset: bytes were left unread)
                rest = await asyncio.wait_for(r.read(), 5)
            except ConnectionResetError:
                rest = b""
            assert rest in (b"", frame(b"")), rest
            assert await closed(r)
        finally:
            await server.close()
        return link.rejected

    assert asyncio.run(run()) == 1


def test_a_malformed_envelope_cuts_the_link_and_answers_nothing_more() -> None:
    async def answer(body: bytes, timeout: float | None) -> bytes:
        return b"ok"

    async def run() -> int:
        link = Link(answer)
        server = await link.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            await asyncio.wait_for(r.readexactly(len(MAGIC)), 5)
            w.write(frame(encode_hello("c", None)))
            assert await read_frame(r) == b""
            w.write(frame(b"\xff\xff\xff"))  # not a PublishStreamRequest
            assert await closed(r)
        finally:
            await server.close()
        assert link.callers == []
        return link.rejected

    assert asyncio.run(run()) == 1


def test_a_connection_without_a_hello_in_time_is_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_link, "HANDSHAKE_TIMEOUT_S", 0.2)

    async def answer(body: bytes, timeout: float | None) -> bytes:
        return b"ok"

    async def run() -> int:
        link = Link(answer)
        server = await link.start()
        try:
            r, _ = await asyncio.open_connection("127.0.0.1", server.port)
            await asyncio.wait_for(r.readexactly(len(MAGIC)), 5)
            assert await closed(r)  # it said nothing
        finally:
            await server.close()
        return link.rejected

    assert asyncio.run(run()) == 1


def test_both_ends_of_a_link_notice_a_dead_peer_within_seconds() -> None:
    """Keepalive probes and a user timeout on the client's and the server's
    socket: a peer that vanished is noticed without waiting for a deadline."""

    async def answer(body: bytes, timeout: float | None) -> bytes:
        return b"ok"

    def timeouts(sock: socket.socket) -> tuple[int, int, int, int, int]:
        return (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        )

    async def run() -> None:
        link = Link(answer)
        server = await link.start()
        try:
            client = await open_link(
                "127.0.0.1", server.port, None, "c", None, lambda f: None, 1 << 20
            )
            assert client.transport is not None
            want = (1, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT, USER_TIMEOUT_MS)
            assert timeouts(client.transport.get_extra_info("socket")) == want
            [served] = server.connections
            assert served.transport is not None
            assert timeouts(served.transport.get_extra_info("socket")) == want
            client.abort()
        finally:
            await server.close()

    asyncio.run(run())
