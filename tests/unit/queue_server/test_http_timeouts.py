"""The queue server's HTTP API bounds its connections (issue 19, finding 12):
a half-sent request is cut after the idle timeout (a byte now and then does
not keep it), so is an idle keep-alive connection; a body that does not
arrive in time gets 408 and the connection closes; an over-long request line
is refused; a body that trickles (a byte now and then) is cut by its total
deadline or its minimum rate (issue 39, finding 4), and bodies read at once
are capped per source. A real aiohttp server on loopback, raw sockets as
clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from queue_server import http_api
from queue_server.auth import Caller
from queue_server.http_api import MAX_LINE_BYTES, BodyLimits, HttpApi
from queue_server.openapi import OPENAPI
from roadlog.v1 import client_pb2

pytestmark = pytest.mark.unit

IDLE_S = 0.5
BODY_S = 0.5
LINGER_S = 0.2
DEADLINE_S = 10.0  # far more than either timeout: a hang fails, not blocks


async def never_called(method: str, body: bytes, timeout: float | None, client: Caller) -> bytes:
    raise AssertionError(f"{method} reached the queues")


def status() -> client_pb2.ClusterStatus:
    return client_pb2.ClusterStatus(leader=1)


Scenario = Callable[[int], Awaitable[None]]


def serve(
    scenario: Scenario,
    bodies: BodyLimits | None = None,
    apis: list[HttpApi] | None = None,
    body_idle_s: float = BODY_S,
) -> None:
    """Run ``scenario`` against a server on loopback (``apis`` gets its HttpApi)."""

    async def main() -> None:
        api = HttpApi(never_called, status, body_idle_s=body_idle_s, bodies=bodies)
        if apis is not None:
            apis.append(api)
        runner = api.runner(idle_timeout_s=IDLE_S, linger_s=LINGER_S)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = runner.addresses[0][1]
            await scenario(port)
        finally:
            await runner.cleanup()

    asyncio.run(main())


async def closed_within(reader: asyncio.StreamReader, deadline_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    t0 = time.monotonic()
    data = await asyncio.wait_for(reader.read(), deadline_s)  # read() ends at EOF
    return data, time.monotonic() - t0


def test_a_half_sent_request_line_is_cut_after_the_idle_timeout() -> None:
    async def scenario(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        writer.write(b"GET /v1/topi")
        await writer.drain()
        data, _ = await closed_within(reader, DEADLINE_S)
        took = time.monotonic() - t0
        assert data == b"", data  # closed, nothing answered
        assert IDLE_S * 0.8 <= took < IDLE_S + 2, took
        writer.close()

    serve(scenario)


def test_a_byte_now_and_then_does_not_keep_a_half_sent_request_alive() -> None:
    async def scenario(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        drip = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
        eof = asyncio.ensure_future(reader.read())
        for b in drip:
            if eof.done() or time.monotonic() - t0 > DEADLINE_S:
                break
            writer.write(bytes([b]))
            await asyncio.wait([eof], timeout=0.05)  # one byte every 50 ms
        try:
            data = await asyncio.wait_for(eof, DEADLINE_S)
        except ConnectionResetError:
            # The server closed with drip bytes unread (they came on after
            # its cut): the kernel answers that with a reset, not a FIN.
            # Closed either way; nothing was answered.
            data = b""
        took = time.monotonic() - t0
        assert data == b"" and took < IDLE_S + 2, (data, took)
        writer.close()

    serve(scenario)


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() -> None:
    async def scenario(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        data, took = await closed_within(reader, DEADLINE_S)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["ok"] is True
        assert took < IDLE_S + 2, took
        writer.close()

    serve(scenario)


def test_a_body_that_does_not_arrive_gets_408_and_the_connection_closes() -> None:
    async def scenario(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/topics HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"name": '
        )
        await writer.drain()
        data, took = await closed_within(reader, DEADLINE_S)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data
        error: dict[str, Any] = json.loads(body)["error"]
        assert error["code"] == "REQUEST_TIMEOUT" and "no byte" in error["reason"], error
        assert BODY_S * 0.8 <= took < BODY_S + LINGER_S + 2, took
        writer.close()

    serve(scenario)


def test_an_over_long_request_line_is_refused() -> None:
    async def scenario(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        path = b"/v1/topics/" + b"a" * (MAX_LINE_BYTES + 10)
        writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        data, _ = await closed_within(reader, DEADLINE_S)
        assert data.split(b" ", 2)[1] in (b"400", b"414"), data[:200]
        # The parser's answer is plain text, and the OpenAPI document says so
        # (a fuzzer holds the server to it).
        head = data.partition(b"\r\n\r\n")[0].decode().lower()
        content_type = head.split("content-type:", 1)[1].split(";", 1)[0].strip()
        status = data.split(b" ", 2)[1].decode()
        documented = OPENAPI["paths"]["/v1/topics/{name}"]["get"]["responses"][status]["content"]
        assert content_type in documented, (content_type, list(documented))
        writer.close()

    serve(scenario)


def test_a_body_that_keeps_coming_is_read_even_past_the_idle_timeout() -> None:
    async def scenario(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"name": "munich", "partitions": 4}'
        writer.write(
            b"POST /v1/topics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        t0 = time.monotonic()
        for i in range(0, len(body), 9):  # a slow link: a piece every 0.3 s
            writer.write(body[i : i + 9])
            await writer.drain()
            await asyncio.sleep(BODY_S * 0.6)
        assert time.monotonic() - t0 > BODY_S * 2
        data, _ = await closed_within(reader, DEADLINE_S)
        # Read whole and judged on its content (no region: 400), not cut with 408.
        assert data.startswith(b"HTTP/1.1 400"), data[:300]
        writer.close()

    serve(scenario)


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    """What the server sent until it closed; a reset after its answer (it
    closes with our trickle unread) keeps what came before it."""
    chunks: list[bytes] = []
    try:
        while chunk := await reader.read(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


async def _trickle(port: int, every_s: float) -> tuple[bytes, float]:
    """A 1 MB body sent a byte every ``every_s`` (so the idle timer never
    fires): what the server answers, and when it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(
        b"POST /v1/topics HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\n\r\n{"
    )
    eof = asyncio.ensure_future(_read_all(reader))
    while not eof.done() and time.monotonic() - t0 < DEADLINE_S:
        with contextlib.suppress(ConnectionError):
            writer.write(b" ")
        await asyncio.wait([eof], timeout=every_s)
    data = await asyncio.wait_for(eof, DEADLINE_S)
    writer.close()
    return data, time.monotonic() - t0


def _error(data: bytes) -> tuple[bytes, dict[str, Any]]:
    head, _, body = data.partition(b"\r\n\r\n")
    return head, json.loads(body)["error"]


def test_a_body_that_trickles_under_the_minimum_rate_gets_408(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http_api, "RATE_GRACE_S", 0.3)

    async def scenario(port: int) -> None:
        data, took = await _trickle(port, every_s=0.05)  # 20 bytes a second
        head, error = _error(data)
        assert head.startswith(b"HTTP/1.1 408"), data
        assert "under the minimum of 1024" in error["reason"], error
        assert took < DEADLINE_S

    serve(scenario, BodyLimits(timeout_s=30, min_rate=1024))


def test_a_body_not_whole_within_its_total_deadline_gets_408() -> None:
    async def scenario(port: int) -> None:
        data, took = await _trickle(port, every_s=0.05)  # never idle, never whole
        head, error = _error(data)
        assert head.startswith(b"HTTP/1.1 408"), data
        assert "not whole within 1.2 s" in error["reason"], error
        assert took < DEADLINE_S

    serve(scenario, BodyLimits(timeout_s=1.2, min_rate=0))


def test_bodies_read_at_once_from_one_address_are_capped_with_429() -> None:
    apis: list[HttpApi] = []

    async def scenario(port: int) -> None:
        head = (
            b"POST /v1/topics HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        slow = []
        for _ in range(2):  # two bodies being read: the cap
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(head)
            slow.append((r, w))
        deadline = time.monotonic() + DEADLINE_S  # until the server reads both (unfinished)
        while sum(apis[0]._reading.values()) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(head)
        data, _ = await closed_within(r, DEADLINE_S)
        status, error = _error(data)
        assert status.startswith(b"HTTP/1.1 429"), data
        assert b"Retry-After: 1" in status and error["code"] == "RESOURCE_EXHAUSTED", data
        assert "2 request bodies" in error["reason"], error
        w.close()
        for _, sw in slow:
            sw.close()

    # The slow bodies must stay unfinished until the third comes: no idle cut.
    serve(scenario, BodyLimits(per_source=2), apis, body_idle_s=DEADLINE_S)


def test_a_body_abandoned_by_its_client_is_counted_not_logged_as_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Anyone can abandon a body at will: no error-level traceback for it
    (issue 39, finding 6), a metric instead."""
    before = http_api.ABANDONED._value.get()

    async def scenario(port: int) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/topics HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n" + b'{"name": '
        )
        await writer.drain()
        writer.close()
        deadline = time.monotonic() + DEADLINE_S
        while http_api.ABANDONED._value.get() == before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    with caplog.at_level("WARNING", logger="roadlog.http"):
        serve(scenario)
    assert http_api.ABANDONED._value.get() == before + 1
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
