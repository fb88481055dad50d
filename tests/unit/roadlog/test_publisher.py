"""The corked publisher against a scripted PublishBatch server (in-process
gRPC on loopback): per-publish retries, deadlines, fail-over, corking. Each
test three times: batches over the queue server's PublishStream service (its
real handler in front of the script); over its publish link (the real
``PublishLinkServer`` in front of the same script, offered by the stream);
and, against a server without either, over unary PublishBatch calls."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from queue_server.auth import Caller
from queue_server.publish_link import PublishLinkServer
from queue_server.publish_stream import publish_stream_handler
from roadlog.client import Connection, InvalidArgument, Unavailable, first_server
from roadlog.client_tls import ClientTLS
from roadlog.errors import RoadlogError
from roadlog.grpc_status import from_grpc
from roadlog.publisher import Publisher
from roadlog.runtime.processes import free_port
from roadlog.v1 import client_pb2

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def plaintext(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripted servers here are plaintext (TLS is the business of
    tests/unit/roadlog/runtime/test_tls.py and
    tests/unit/node_daemon/transport/test_tls_identity.py)."""
    monkeypatch.setenv("ROADLOG_INSECURE", "1")
    monkeypatch.setenv("ROADLOG_CLIENT_ID", "c1")  # what the link's hello declares


UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]

# request bytes -> the code to answer it with this time (0: store it)
Script = Callable[[bytes, int], int]


class Scripted:
    """Answers each request of a batch by the script; counts calls."""

    def __init__(self, script: Script, abort: grpc.StatusCode | None = None) -> None:
        self.script = script
        self.abort = abort
        self.calls: list[list[bytes]] = []
        self.seen: dict[bytes, int] = {}
        self.out = 0  # calls being answered now
        self.most_out = 0

    async def handle(self, body: bytes, context: Any) -> bytes:
        reqs = list(client_pb2.PublishBatchRequestView.FromString(body).requests)
        self.calls.append(reqs)
        if self.abort is not None:
            await context.abort(self.abort, "scripted failure")
        out = client_pb2.PublishBatchResponseView()
        for r in reqs:
            n = self.seen[r] = self.seen.get(r, 0) + 1
            code = self.script(r, n)
            resp = client_pb2.PublishResponse(applied_index=len(self.calls)).SerializeToString()
            out.results.add(code=code, message=f"scripted {code}", response=b"" if code else resp)
        self.out += 1
        self.most_out = max(self.most_out, self.out)
        await asyncio.sleep(0.01)  # let more publishes pile up behind this call
        self.out -= 1
        return out.SerializeToString()


STREAMED = {"on": True}  # the servers offer PublishStream (see the fixture)
LINKED = {"on": False}  # ... and a publish link


@pytest.fixture(autouse=True, params=["stream", "link", "unary"])
def transport(request: pytest.FixtureRequest) -> str:
    STREAMED["on"] = request.param in ("stream", "link")
    LINKED["on"] = request.param == "link"
    return str(request.param)


class _Aborted:
    """The context a scripted handler aborts through, as a queue server's
    ``call`` would fail: a RoadlogError."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RoadlogError(from_grpc(code), details)


def _call(handler: Scripted) -> Callable[[str, bytes, float | None, Caller], Any]:
    async def call(method: str, body: bytes, timeout: float | None, client: Caller) -> bytes:
        assert method == "PublishBatch" and timeout and client.declared == "c1"
        return await handler.handle(body, _Aborted())

    return call


class Served:
    """A scripted queue server: gRPC, and its publish link where offered."""

    def __init__(self, grpc_server: grpc.aio.Server, link: PublishLinkServer | None) -> None:
        self.grpc = grpc_server
        self.link = link

    async def stop(self, grace: float | None) -> None:
        if self.link is not None:
            await self.link.close()  # its links break, as the stream does
        await self.grpc.stop(grace)


async def serve(handler: Scripted) -> tuple[Served, str]:
    server = grpc.aio.server()
    handlers = [
        grpc.method_handlers_generic_handler(
            "roadlog.v1.Roadlog",
            {"PublishBatch": grpc.unary_unary_rpc_method_handler(handler.handle)},
        )
    ]
    link: PublishLinkServer | None = None
    if LINKED["on"]:
        link = PublishLinkServer(_call(handler), lambda code: None, lambda: None, None)
        await link.start("127.0.0.1", 0)
    if STREAMED["on"]:
        port = link.port if link is not None else 0
        handlers.append(
            publish_stream_handler(
                _call(handler), lambda ctx: Caller(None, "", "c1"), lambda code: None, lambda: port
            )
        )
    server.add_generic_rpc_handlers(tuple(handlers))
    addr = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(addr)
    await server.start()
    return Served(server, link), addr


def req(i: int) -> bytes:
    return client_pb2.PublishRequest(topic="t", sequence=i).SerializeToString()


def test_publishes_are_corked_and_each_is_answered() -> None:
    async def run() -> tuple[Scripted, list[Any]]:
        h = Scripted(lambda r, n: INVALID if r == req(5) else 0)
        server, addr = await serve(h)
        try:
            async with Publisher([addr], max_in_flight=1) as pub:
                out = await asyncio.gather(
                    *(pub.publish(req(i)) for i in range(40)), return_exceptions=True
                )
                assert pub.fence == len(h.calls)
                # Over the stream where the server has it; unary otherwise.
                assert [s.unary_only for s in pub._calls] == [not STREAMED["on"]]
                return h, out
        finally:
            await server.stop(None)

    h, out = asyncio.run(run())
    assert isinstance(out[5], InvalidArgument) and "scripted" in str(out[5])
    assert all(isinstance(o, client_pb2.PublishResponse) for i, o in enumerate(out) if i != 5)
    assert len(h.calls) < 40 and sum(len(c) for c in h.calls) == 40
    assert [r for c in h.calls for r in c] == [req(i) for i in range(40)]  # in order


def test_full_batches_go_out_at_once_small_ones_wait_for_a_slot() -> None:
    def big(i: int) -> bytes:
        return client_pb2.PublishRequest(
            topic="t", sequence=i, client_id="x" * 3000
        ).SerializeToString()

    async def run(make: Callable[[int], bytes]) -> Scripted:
        h = Scripted(lambda r, n: 0)
        server, addr = await serve(h)
        try:
            async with Publisher([addr], max_in_flight=1, max_batch_bytes=10_000) as pub:
                await asyncio.gather(*(pub.publish(make(i)) for i in range(40)))
            return h
        finally:
            await server.stop(None)

    small = asyncio.run(run(req))
    assert small.most_out == 1  # corked behind the one call out
    large = asyncio.run(run(big))
    assert large.most_out > 1  # 3 KB each: batches fill up and pipeline
    assert max(len(c) for c in large.calls) <= 4  # never past max_batch_bytes


def test_a_retryable_answer_sends_that_publish_again_only() -> None:
    async def run() -> tuple[Scripted, list[Any]]:
        # Request 3 is refused as UNAVAILABLE twice, then stored.
        h = Scripted(lambda r, n: UNAVAILABLE if r == req(3) and n <= 2 else 0)
        server, addr = await serve(h)
        try:
            async with Publisher([addr]) as pub:
                out = await asyncio.gather(*(pub.publish(req(i)) for i in range(8)))
                assert pub.stats.retried == 2
                return h, list(out)
        finally:
            await server.stop(None)

    h, out = asyncio.run(run())
    assert len(out) == 8
    assert h.seen[req(3)] == 3
    assert all(h.seen[req(i)] == 1 for i in range(8) if i != 3)


def test_a_publish_that_never_gets_through_fails_at_its_deadline_with_the_reason() -> None:
    async def run() -> Exception:
        h = Scripted(lambda r, n: UNAVAILABLE)
        server, addr = await serve(h)
        try:
            async with Publisher([addr]) as pub:
                with pytest.raises(Unavailable) as e:
                    await pub.publish(req(1), timeout=0.5)
                return e.value
        finally:
            await server.stop(None)

    err = asyncio.run(run())
    assert "scripted" in str(err)


@pytest.mark.parametrize("status", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_failed_call_fails_over_to_the_next_queue_server(status: grpc.StatusCode) -> None:
    """A queue server that cannot take the call, or cancels it (as a server
    that stops cancels every call it holds), sends the publishes on to the
    next one."""

    async def run() -> tuple[Scripted, Scripted]:
        down = Scripted(lambda r, n: 0, abort=status)
        up = Scripted(lambda r, n: 0)
        s1, a1 = await serve(down)
        s2, a2 = await serve(up)
        try:
            async with Publisher([a1, a2]) as pub:
                pub._current = 0  # it starts at the one that is down
                await asyncio.gather(*(pub.publish(req(i)) for i in range(5)))
            return down, up
        finally:
            await s1.stop(None)
            await s2.stop(None)

    down, up = asyncio.run(run())
    assert down.calls and sum(len(c) for c in up.calls) == 5


def test_a_refused_call_fails_its_publishes_at_once() -> None:
    async def run() -> None:
        h = Scripted(lambda r, n: 0, abort=grpc.StatusCode.INVALID_ARGUMENT)
        server, addr = await serve(h)
        try:
            async with Publisher([addr]) as pub:
                with pytest.raises(InvalidArgument):
                    await pub.publish(req(1))
            assert len(h.calls) == 1
        finally:
            await server.stop(None)

    asyncio.run(run())


class Gated(Scripted):
    """Stores every publish, but holds each call until the test lets it go."""

    def __init__(self) -> None:
        super().__init__(lambda r, n: 0)
        self.gates: list[asyncio.Event] = []

    async def handle(self, body: bytes, context: Any) -> bytes:
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        return await super().handle(body, context)


async def _until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_a_second_call_waits_until_as_many_publish_as_the_call_out_carries() -> None:
    """Balanced corking: a lone publish goes at once; with a call of 8 out,
    3 waiting publishes stay corked, and the 8th one waiting sends them all
    in the second call."""

    async def run() -> list[int]:
        h = Gated()
        server, addr = await serve(h)
        try:
            async with Publisher([addr], max_in_flight=2) as pub:
                first = [asyncio.ensure_future(pub.publish(req(0)))]
                await _until(lambda: len(h.gates) == 1, "the lone publish to go out at once")
                more = [asyncio.ensure_future(pub.publish(req(i))) for i in range(1, 9)]
                await _until(lambda: len(h.gates) == 2, "the second call, of one publish")
                h.gates[0].set()  # 7 wait now, more than the 1 of the call out
                await _until(lambda: len(h.gates) == 3, "a call of the 7 waiting")
                h.gates[1].set()
                await asyncio.gather(*first, *more[:1])
                # One call of 7 is out: 3 new publishes are fewer, and wait.
                late = [asyncio.ensure_future(pub.publish(req(i))) for i in range(9, 12)]
                for _ in range(20):
                    await asyncio.sleep(0)
                assert len(h.gates) == 3 and pub.stats.calls == 3
                late += [asyncio.ensure_future(pub.publish(req(i))) for i in range(12, 16)]
                await _until(lambda: len(h.gates) == 4, "a call once 7 wait")
                for g in h.gates:
                    g.set()
                await asyncio.gather(*more, *late)
                return [len(c) for c in h.calls]
        finally:
            await server.stop(None)

    sizes = asyncio.run(run())
    assert sizes == [1, 1, 7, 7]


def test_senders_in_a_closed_loop_all_ride_in_one_call() -> None:
    """Senders that each publish again once answered: a call's answered
    senders get their turn before the next call goes out, so after the
    start every call carries every sender's publish, one replication round
    for all, instead of calls of one and of the rest taking turns."""
    senders, each = 8, 10

    async def run() -> list[int]:
        h = Scripted(lambda r, n: 0)
        server, addr = await serve(h)
        try:
            async with Publisher([addr], max_in_flight=2) as pub:

                async def sender(k: int) -> None:
                    for i in range(each):
                        await pub.publish(req(k * each + i))

                await asyncio.gather(*(sender(k) for k in range(senders)))
                return [len(c) for c in h.calls]
        finally:
            await server.stop(None)

    sizes = asyncio.run(run())
    assert sum(sizes) == senders * each
    assert statistics.median(sizes) == senders, sizes
    assert len(sizes) <= each + 3, sizes


class Hanging(Scripted):
    """Takes calls and never answers them (until its server is stopped)."""

    def __init__(self) -> None:
        super().__init__(lambda r, n: 0)
        self.took = asyncio.Event()

    async def handle(self, body: bytes, context: Any) -> bytes:
        self.calls.append(list(client_pb2.PublishBatchRequestView.FromString(body).requests))
        self.took.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


def test_publishes_out_on_a_queue_server_that_dies_go_to_the_next() -> None:
    """The queue server holding a call (or a stream with batches on it)
    goes away: those publishes are sent again, to the next one, and every
    publish is answered once."""

    async def run() -> tuple[Hanging, Scripted, list[Any]]:
        dying, up = Hanging(), Scripted(lambda r, n: 0)
        s1, a1 = await serve(dying)
        s2, a2 = await serve(up)
        try:
            async with Publisher([a1, a2], timeout=20) as pub:
                pub._current = 0  # it starts at the one that dies
                pending = [asyncio.ensure_future(pub.publish(req(i))) for i in range(5)]
                await asyncio.wait_for(dying.took.wait(), 10)
                await s1.stop(None)  # the held call or stream breaks
                out = await asyncio.gather(*pending, return_exceptions=True)
            return dying, up, out
        finally:
            await s2.stop(None)

    dying, up, out = asyncio.run(run())
    assert all(isinstance(o, client_pb2.PublishResponse) for o in out), out
    assert dying.calls  # it had taken some
    assert sorted(r for c in up.calls for r in c) == sorted(req(i) for i in range(5))


def test_new_connections_spread_over_the_queue_servers() -> None:
    """A connection calls any queue server first (then fails over in turn),
    so that many clients do not all load the first one listed."""
    seen = {first_server(3) for _ in range(300)}
    assert seen == {0, 1, 2}
    assert first_server(1) == 0
    servers = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    tls = ClientTLS(insecure=True)
    firsts = set()
    for _ in range(60):
        conn = Connection(servers, tls=tls)
        firsts.add(conn._current)
        conn.close()
    assert firsts == {0, 1, 2}
    assert {Publisher(servers, tls=tls)._current for _ in range(60)} == {0, 1, 2}


def test_calls_go_over_the_offered_publish_link_and_back_to_the_stream_when_it_breaks(
    transport: str,
) -> None:
    """Once the stream offered a link and it is up, calls go over it; when
    the link is cut, calls in flight there are sent again and the next go
    over the stream until the link is dialled again; every publish is
    answered once."""
    if transport != "link":
        pytest.skip("the publish link's own test")

    async def run() -> None:
        h = Scripted(lambda r, n: 0)
        server, addr = await serve(h)
        assert server.link is not None
        try:
            async with Publisher([addr], timeout=20) as pub:
                for i in range(10):
                    await pub.publish(req(i))
                stream = pub._calls[0]
                assert stream._link is not None and pub.linked >= 7, pub.linked
                # The link's server cuts every link (and takes no new one).
                server.link._listener.close()
                for c in list(server.link.connections):
                    c.abort()
                linked = pub.linked
                out = await asyncio.gather(*(pub.publish(req(i)) for i in range(10, 30)))
                assert all(isinstance(o, client_pb2.PublishResponse) for o in out)
                assert pub.linked == linked  # the stream served them
                assert not stream._link  # and no link is up
            assert pub.stats.failed == 0
            sent = [r for call in h.calls for r in call]
            assert {req(i) for i in range(30)} <= set(sent)
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_a_link_that_cannot_be_dialled_is_tried_again_later_and_later(transport: str) -> None:
    """A queue server that offers a link no client can reach (a firewall):
    every publish goes over the stream, and the dials back off."""
    if transport != "link":
        pytest.skip("the publish link's own test")

    async def run() -> None:
        h = Scripted(lambda r, n: 0)
        server, addr = await serve(h)
        assert server.link is not None
        await server.link.close()  # offered, but nobody answers there
        try:
            async with Publisher([addr], timeout=20) as pub:
                waits = []
                for i in range(3):
                    await pub.publish(req(i))  # learns the port; dials in the background
                    await pub.publish(req(100 + i))
                    stream = pub._calls[0]
                    dialing = stream._dialing
                    assert dialing is not None
                    await asyncio.wait_for(asyncio.shield(dialing), 10)
                    waits.append(stream._dial_after - time.monotonic())
                    stream._dial_after = 0.0  # let the next publish dial again
                assert pub.linked == 0 and pub.stats.failed == 0
                assert waits[0] < waits[1] < waits[2], waits  # 2, 4, 8 s
        finally:
            await server.stop(None)

    asyncio.run(run())


class Redirecting(Scripted):
    """Names another home for every publish (a topic moved away), the call
    holding the first publish answered last."""

    def __init__(self, home: str) -> None:
        super().__init__(lambda r, n: 0)
        self.home = home

    async def handle(self, body: bytes, context: Any) -> bytes:
        reqs = list(client_pb2.PublishBatchRequestView.FromString(body).requests)
        self.calls.append(reqs)
        await asyncio.sleep(0.3 if req(0) in reqs else 0.01)
        out = client_pb2.PublishBatchResponseView()
        code = grpc.StatusCode.FAILED_PRECONDITION.value[0]
        for _ in reqs:
            out.results.add(code=code, message=f"moved [roadlog-topic-home: new={self.home}]")
        return out.SerializeToString()


def test_publishes_redirected_reach_the_new_home_in_publish_order() -> None:
    """An idempotent producer's sequences reach a moved topic's new home in
    order although the old home answered its calls out of order: nothing
    goes there while a call to the old one is out."""

    async def run() -> tuple[Scripted, Redirecting]:
        new = Scripted(lambda r, n: 0)
        new_server, new_addr = await serve(new)
        old = Redirecting(new_addr)
        old_server, old_addr = await serve(old)
        try:
            async with Publisher([old_addr], max_in_flight=4, max_batch_requests=4) as pub:
                sends = []
                for i in range(16):
                    sends.append(asyncio.ensure_future(pub.publish(req(i))))
                    await asyncio.sleep(0)  # each its own turn: several calls go out
                await asyncio.gather(*sends)
                assert pub.cluster == "new"
            return new, old
        finally:
            await old_server.stop(None)
            await new_server.stop(None)

    new, old = asyncio.run(run())
    assert len(old.calls) > 1  # the publishes went out in several calls
    arrived = [r for call in new.calls for r in call]
    assert arrived == [req(i) for i in range(16)]
