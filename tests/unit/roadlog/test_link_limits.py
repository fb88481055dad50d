"""What a framed port lets anyone hold (``roadlog.link_limits``): buffers
that grow as bytes arrive against one budget, caps counted before TLS,
clocks that cut a frame begun and not whole, an idle link and a hello not
said, and the publish link's hello authenticated before anything else is
read, on real sockets in TLS on both event loops."""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from queue_server.auth import Caller
from queue_server.publish_link import PublishLinkServer
from roadlog import link_limits
from roadlog.errors import Code, RoadlogError
from roadlog.framing import LEN, FrameReader
from roadlog.link_limits import FrameBudget, LinkGuard, LinkLimits, source_key
from roadlog.publish_link import MAGIC, HelloRefused, encode_hello, open_link
from tests.certs import ClusterCA
from tests.unit.support.loops import LOOPS, run_bounded, until, use_loop

pytestmark = pytest.mark.unit

MiB = 1 << 20


def frame(payload: bytes) -> bytes:
    return LEN.pack(len(payload)) + payload


# ---------------------------------------------------------------- buffers


def test_a_frame_headers_claim_buys_nothing_until_its_bytes_arrive() -> None:
    r = FrameReader(64 * MiB)
    payload = random.Random(1).randbytes(16 * MiB)
    assert r.feed(LEN.pack(len(payload)) + payload[:1000]) == []
    assert r.capacity <= FrameReader.SCRATCH + FrameReader.FIRST_BIG  # not 16 MiB
    got = 1000
    while got < len(payload):
        step = min(300_000, len(payload) - got)
        out = r.feed(payload[got : got + step])
        got += step
        # what it holds is at most GROWTH times what came (or the first buffer)
        assert r.capacity - FrameReader.SCRATCH <= max(
            FrameReader.FIRST_BIG, FrameReader.GROWTH * got
        )
    assert out == [payload]
    assert r.pending == 0


def test_readers_on_one_budget_wait_for_it_and_every_frame_comes_out_whole() -> None:
    """Readers of random frames over a budget far smaller than their frames
    together: a starved reader is fed nothing until ``retry`` lets it (as a
    paused socket), the budget is never overdrawn, no circle of readers
    waits for each other (each begun frame was granted whole), and every
    frame comes out whole and in order."""
    rng = random.Random(7)
    budget = FrameBudget(4 * MiB)
    readers = [FrameReader(4 * MiB, budget=budget) for _ in range(6)]
    streams = []
    for _ in readers:
        frames = [rng.randbytes(rng.choice([10, 70_000, 900_000, 3 * MiB])) for _ in range(8)]
        streams.append((frames, b"".join(frame(f) for f in frames)))
    sent = [0] * len(readers)
    out: list[list[bytes]] = [[] for _ in readers]
    waiting: set[int] = set()
    for _ in range(100_000):
        live = [i for i in range(len(readers)) if sent[i] < len(streams[i][1])]
        if not live:
            break
        for i in list(waiting):
            if readers[i].retry():
                waiting.discard(i)
        ready = [i for i in live if i not in waiting]
        assert ready, "every reader starved at once: the budget deadlocked"
        i = rng.choice(ready)
        data = streams[i][1]
        room = readers[i].get_buffer()
        n = min(len(room), rng.randint(1, 400_000), len(data) - sent[i])
        room[:n] = data[sent[i] : sent[i] + n]
        sent[i] += n
        out[i] += readers[i].updated(n)
        if readers[i].starved:
            waiting.add(i)
        assert budget.used <= budget.total
        held = sum(r.capacity - FrameReader.SCRATCH for r in readers)
        assert held <= budget.total  # what the buffers hold is within what was granted
    assert [o for o in out] == [s[0] for s in streams]
    assert budget.used == 0  # every big buffer given back as its frame went on
    assert budget.peak > budget.total // 2  # the budget was what limited them


def test_a_reader_gives_back_what_it_holds_when_its_link_goes() -> None:
    budget = FrameBudget(8 * MiB)
    r = FrameReader(8 * MiB, budget=budget)
    r.feed(LEN.pack(5 * MiB) + b"x" * 100_000)
    assert budget.used == 5 * MiB  # the frame's length, granted as it began
    r.release()
    assert budget.used == 0


def test_a_frame_waits_for_its_whole_length_and_its_turn() -> None:
    budget = FrameBudget(4 * MiB)
    first, second, third = (FrameReader(4 * MiB, budget=budget) for _ in range(3))
    woken: list[str] = []
    assert first.feed(LEN.pack(3 * MiB) + b"a" * 1000) == [] and not first.starved
    assert second.feed(LEN.pack(2 * MiB) + b"b" * 1000) == [] and second.starved

    def waiter(reader: FrameReader, name: str) -> Callable[[], bool]:
        def retry() -> bool:
            if reader.retry():
                woken.append(name)
                return True
            return False

        return retry

    budget.wait(waiter(second, "second"))
    # It would fit, but the second is first in line: it waits behind it.
    assert third.feed(LEN.pack(100_000) + b"c" * 1000) == [] and third.starved
    budget.wait(waiter(third, "third"))
    assert budget.waiting == 2 and budget.used == 3 * MiB
    assert first.feed(b"a" * (3 * MiB - 1000)) == [b"a" * (3 * MiB)]
    # 4 MiB free: the second begins, then the third (first come, first served)
    assert woken == ["second", "third"] and budget.used == 2 * MiB + 100_000
    assert second.feed(b"b" * (2 * MiB - 1000)) == [b"b" * (2 * MiB)]
    assert third.feed(b"c" * 99_000) == [b"c" * 100_000]
    assert budget.used == 0


def test_a_frame_longer_than_the_whole_budget_is_refused() -> None:
    r = FrameReader(16 * MiB, budget=FrameBudget(8 * MiB))
    with pytest.raises(ValueError, match="budget"):
        r.feed(LEN.pack(9 * MiB) + b"x" * 100_000)


# ---------------------------------------------------------------- the guard


@dataclass(eq=False)
class FakeConn:
    source: str
    authenticated: bool = False
    received: int = 0
    frames: int = 0
    pending: int = 0
    paused: bool = False
    cut: list[str] = field(default_factory=list)

    def clocks(self) -> tuple[int, int, int]:
        return self.received, self.frames, self.pending

    @property
    def paused_by_us(self) -> bool:
        return self.paused

    def refuse(self, why: str) -> None:
        self.cut.append(why)

    def close_idle(self, why: str) -> None:
        self.cut.append("idle")


def test_caps_count_strangers_and_links_per_source_and_in_all() -> None:
    async def body() -> None:
        lim = LinkLimits(
            max_links=8, max_links_per_source=4, max_strangers=4, max_strangers_per_source=2
        )
        cuts: list[str] = []
        g = LinkGuard(lim, cuts.append)

        def conns(src: str, n: int) -> list[FakeConn]:
            return [FakeConn(src) for _ in range(n)]

        a, b, c, d = conns("10.0.0.1", 5), conns("10.0.0.2", 3), conns("10.0.0.3", 3), conns("d", 2)
        assert [g.admit(x) for x in a[:3]] == ["", "", "strangers_per_source"]
        g.known(a[0])  # past its hello: its source may have another stranger
        assert g.admit(a[2]) == ""
        assert [g.admit(x) for x in b[:2]] == ["", ""]
        assert g.strangers == 4 and g.links == 5
        assert g.admit(c[0]) == "strangers"  # 4 strangers in all
        for x in (a[1], a[2], b[0]):
            g.known(x)
        assert [g.admit(x) for x in (c[1], *d)] == ["", "", ""]
        assert g.links == 8
        assert g.admit(c[2]) == "links"  # 8 links in all
        g.gone(b[1])
        g.gone(b[1])  # twice: counted once
        assert g.links == 7 and g.strangers == 3
        assert g.admit(a[3]) == ""  # the 4th of 10.0.0.1
        g.gone(c[1])
        assert g.admit(a[4]) == "links_per_source"
        assert cuts == ["strangers_per_source", "strangers", "links", "links_per_source"]
        assert g.refused == 4

    asyncio.run(body())


def test_clocks_cut_a_stalled_frame_a_silent_hello_and_an_idle_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(link_limits, "SWEEP_S", 0.02)
    lim = LinkLimits(handshake_s=0.3, idle_s=0.3, frame_s=0.2, min_rate=1 << 20)

    async def body() -> None:
        g = LinkGuard(lim)
        silent = FakeConn("a")  # never says its hello
        stalled = FakeConn("b", authenticated=True)  # a frame begun, no byte more
        trickle = FakeConn("c", authenticated=True)  # a frame whose bytes keep coming
        idle = FakeConn("d", authenticated=True)
        paused = FakeConn("e", authenticated=True, paused=True, pending=100)
        busy = FakeConn("f", authenticated=True)  # frames complete all the time
        for c in (silent, stalled, trickle, idle, paused, busy):
            assert g.admit(c) == ""
            if c.authenticated:
                c.authenticated = False
                g.known(c)
        stalled.received, stalled.pending = 10, 1000
        trickle.pending = 1000
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.0
        while loop.time() < end:
            trickle.received += 1  # 1 byte a tick: the frame never completes
            busy.received += 100
            busy.frames += 1
            await asyncio.sleep(0.01)
        assert silent.cut == ["no hello in time"]
        assert stalled.cut == ["a frame not whole in time"]
        assert trickle.cut == ["a frame not whole in time"]  # bytes alone do not save it
        assert idle.cut == ["idle"]
        assert paused.cut == [] and busy.cut == []  # held by us / progressing
        assert g.links == 2

    asyncio.run(body())


def test_an_ipv4_mapped_address_counts_as_its_ipv4_one() -> None:
    assert source_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert source_key("10.1.2.3") == "10.1.2.3"
    assert source_key("fe80::1%eth0") == "fe80::1"
    assert source_key("") == ""


def test_limits_refuse_a_cap_of_nothing() -> None:
    with pytest.raises(ValueError):
        LinkLimits(max_strangers=0)
    with pytest.raises(ValueError):
        LinkLimits(buffer_bytes=1000)


# ------------------------------------------------- the publish link in TLS


@pytest.fixture(params=LOOPS)
def loop_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    return use_loop(request, monkeypatch)


GOOD = "Bearer rl_good"


class Served:
    def __init__(self, test_ca: ClusterCA, limits: LinkLimits | None = None) -> None:
        self.creds = test_ca.creds("queue")
        self.client_ctx = ssl.create_default_context(cafile=str(test_ca.ca_file))
        self.checked: list[Caller] = []
        self.calls: list[Caller] = []
        self.rejected = 0
        self.limits = limits or LinkLimits()

    async def authenticate(self, caller: Caller) -> object:
        self.checked.append(caller)
        if caller.credential != GOOD:
            raise RoadlogError(Code.UNAUTHENTICATED, "no such token")
        return caller.credential

    async def call(self, method: str, body: bytes, timeout: float | None, who: Caller) -> bytes:
        self.calls.append(who)
        return b"ok"

    async def start(self) -> PublishLinkServer:
        def reject() -> None:
            self.rejected += 1

        s = PublishLinkServer(
            self.call,
            lambda code: None,
            reject,
            self.creds.server_ssl(mutual=False),
            authenticate=self.authenticate,
            limits=self.limits,
        )
        await s.start("127.0.0.1", 0)
        return s


def test_a_hello_without_a_good_token_is_refused_with_its_reason_and_closed(
    loop_kind: str, test_ca: ClusterCA
) -> None:
    served = Served(test_ca)

    async def body() -> None:
        server = await served.start()
        try:
            for credential in (None, "Bearer rl_made_up"):
                with pytest.raises(HelloRefused, match="UNAUTHENTICATED: no such token"):
                    await open_link(
                        "127.0.0.1",
                        server.port,
                        served.client_ctx,
                        "c",
                        credential,
                        lambda f: None,
                        1 << 20,
                    )
            # and by hand: the refusal, then the end, nothing read after the hello
            r, w = await asyncio.open_connection(
                "127.0.0.1", server.port, ssl=served.client_ctx, server_hostname="127.0.0.1"
            )
            assert await r.readexactly(len(MAGIC)) == MAGIC
            w.write(frame(encode_hello("c", None)) + frame(b"a batch, sent too soon"))
            # (kept for after the answer; the hello refused, it is dropped)
            (n,) = LEN.unpack(await r.readexactly(4))
            assert (await r.readexactly(n)).startswith(b"UNAUTHENTICATED")
            assert await asyncio.wait_for(r.read(), 5) == b""
            w.close()
            link = await open_link(
                "127.0.0.1", server.port, served.client_ctx, "c", GOOD, lambda f: None, 1 << 20
            )
            assert not link.closed
            link.abort()
            await until(lambda: not server.connections, "the links gone")
        finally:
            await server.close()
        assert served.calls == []  # nothing of the refused links was answered
        assert [c.credential for c in served.checked] == [None, "Bearer rl_made_up", None, GOOD]
        assert served.rejected == 3
        assert server.guard.links == 0 and server.guard.strangers == 0

    run_bounded(body)


def test_links_over_the_caps_are_closed_before_their_tls_handshake(
    loop_kind: str, test_ca: ClusterCA
) -> None:
    served = Served(test_ca, LinkLimits(max_links=3, max_strangers=2, max_strangers_per_source=2))

    async def body() -> None:
        server = await served.start()
        try:
            # Two strangers hold both stranger slots: plain TCP, saying nothing.
            held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
            await until(lambda: server.guard.strangers == 2, "two strangers counted")
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                await asyncio.wait_for(
                    open_link(
                        "127.0.0.1",
                        server.port,
                        served.client_ctx,
                        "c",
                        GOOD,
                        lambda f: None,
                        1 << 20,
                    ),
                    5,
                )
            assert server.guard.refused == 1
            for _, w in held:
                w.close()
            await until(lambda: server.guard.strangers == 0, "the strangers gone")
            link = await open_link(
                "127.0.0.1", server.port, served.client_ctx, "c", GOOD, lambda f: None, 1 << 20
            )
            assert server.guard.strangers == 0 and server.guard.links == 1
            link.abort()
        finally:
            await server.close()

    run_bounded(body)


# ------------------------------------------- the links between roadlog's processes


def test_a_framed_servers_guard_cuts_a_stalled_frame_and_refuses_over_its_caps(
    loop_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Work and peer links' server (``roadlog.runtime.frames``) under its
    scheme's limits: a second stranger is reset at accept, and an
    authenticated link whose frame stalls is cut by its clock while
    another link's frames flow."""
    from roadlog.runtime import frames

    monkeypatch.setattr(link_limits, "SWEEP_S", 0.05)
    scheme = frames.Scheme(
        b"RLTEST01",
        b"roadlog test frames v1",
        1 << 20,
        LinkLimits(max_strangers=1, frame_s=0.3, min_rate=1 << 30, buffer_bytes=4 * MiB),
    )
    secret = b"s" * 32
    got: list[bytes] = []

    async def body() -> None:
        server = frames.FramedServer(
            scheme, "c", secret, lambda conn: got.append, lambda: None, ssl_context=None
        )
        port = await server.start("127.0.0.1", 0)
        try:
            silent = await asyncio.open_connection("127.0.0.1", port)  # the one stranger
            await until(lambda: server.guard.strangers == 1, "the stranger counted")
            try:  # reset at accept: the connect or the first read fails, no greeting
                r, _ = await asyncio.open_connection("127.0.0.1", port)
                assert await asyncio.wait_for(r.read(), 5) == b""
            except ConnectionResetError:
                pass
            assert server.guard.refused == 1
            silent[1].close()
            await until(lambda: server.guard.strangers == 0, "the stranger gone")
            good = await frames.connect(scheme, "127.0.0.1", port, "c", secret, 1, ssl_context=None)
            stalled = await frames.connect(
                scheme, "127.0.0.1", port, "c", secret, 2, ssl_context=None
            )
            assert stalled.transport is not None
            stalled.transport.write(LEN.pack(500_000) + b"x" * 100)  # and no byte more
            await good.send(b"first")
            await until(lambda: stalled.closed, "the stalled frame's link cut", timeout=5)
            await good.send(b"second")
            await until(lambda: got == [b"first", b"second"], "the good link's frames")
            assert not good.closed
            assert server.guard.budget.used == 0  # the stalled frame's grant given back
            good.abort()
        finally:
            await server.close()

    run_bounded(body)
