"""TLS on the links between roadlog's processes: Raft messages flow between
nodes over mutual TLS (framed link and gRPC stream), a node's certificate
cannot speak for another node (the Raft ``from`` field, the framed links'
hello, the Work link's node), plaintext callers and certificates of another
CA are refused, and daemons refuse to start without credentials or with a
key file others may read."""

from __future__ import annotations

import asyncio
import os
import ssl
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from node_daemon.process import main as node_main
from node_daemon.raft import Message, MessageType
from node_daemon.transport.peer_frames import (
    _HELLO,
    MAGIC,
    NONCE_BYTES,
    FramesLink,
    frames_key,
    hello_mac,
)
from node_daemon.transport.peer_transport import PeerTransport
from queue_server import main as queue_main
from roadlog.runtime import frames, tls
from roadlog.v1 import raft_pb2, raft_pb2_grpc
from tests.certs import ClusterCA
from tests.unit.node_daemon.transport.peer_transports import peer_transport
from tests.unit.support.loops import LOOPS, run_bounded, until, use_loop

pytestmark = pytest.mark.unit

SECRET = b"t" * 32
CLUSTER = "tls-test"


@pytest.fixture(autouse=True, params=LOOPS)
def event_loop_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    return use_loop(request, monkeypatch)


@pytest.fixture(autouse=True)
def keep_process_security() -> Iterator[None]:
    """Whatever a test (or a daemon's ``run`` it invokes) installs, the
    process is plaintext again after it, as every other unit test expects."""
    before = tls.current()
    yield
    tls.install(before)


@pytest.fixture
def as_node_1(test_ca: ClusterCA) -> Iterator[tls.Security]:
    """This process speaks as node 1 (what a node daemon installs at start)."""
    before = tls.current()
    yield tls.install(test_ca.security("node", 1))
    tls.install(before)


def _transport(node_id: int, tmp: Path, got: list[Message]) -> PeerTransport:
    return peer_transport(node_id, CLUSTER, SECRET, tmp, got)


async def _serving(
    t: PeerTransport, security: tls.Security, frames_on: bool
) -> tuple[grpc.aio.Server, str]:
    from node_daemon.process.admin import node_callers

    server = grpc.aio.server(interceptors=[tls.CertAuth(node_callers)])
    raft_pb2_grpc.add_RaftPeerServicer_to_server(t, server)
    port = security.add_port(server, "127.0.0.1:0", mutual=True)
    await server.start()
    if frames_on:
        assert await t.start_frames("127.0.0.1", 0) > 0
    return server, f"127.0.0.1:{port}"


def _heartbeat(frm: int, to: int = 2) -> Message:
    return Message(MessageType.HEARTBEAT, to, frm, term=1)


@pytest.mark.parametrize("frames_on", [True, False], ids=["frames", "grpc"])
def test_raft_messages_flow_between_nodes_in_mutual_tls(
    tmp_path: Path, test_ca: ClusterCA, as_node_1: tls.Security, frames_on: bool
) -> None:
    async def body() -> None:
        got: list[Message] = []
        b = _transport(2, tmp_path, got)
        server, addr = await _serving(b, test_ca.security("node", 2), frames_on)
        a = _transport(1, tmp_path, [])
        a.set_addresses({2: addr})
        try:
            sent = [_heartbeat(1) for _ in range(20)]
            a.send(sent)
            await until(lambda: len(got) == 20, "20 messages")
            assert got == sent and b.rejected == 0
            assert bool(b.frames and b.frames.connections) == frames_on
        finally:
            await a.close()
            await b.close()
            await server.stop(None)

    run_bounded(body)


def _batch(frm: int, msg_from: int) -> raft_pb2.RaftBatch:
    m = raft_pb2.RaftMessage(type=int(MessageType.HEARTBEAT), to=2, term=1)
    setattr(m, "from", msg_from)
    b = raft_pb2.RaftBatch(cluster=CLUSTER, messages=[m])
    setattr(b, "from", frm)
    return b


@pytest.mark.parametrize("claim", ["batch", "message"])
def test_a_node_certificate_cannot_claim_another_node_on_the_grpc_stream(
    tmp_path: Path, test_ca: ClusterCA, as_node_1: tls.Security, claim: str
) -> None:
    """Node 3's certificate, a batch or message saying it is from node 1."""

    async def body() -> None:
        got: list[Message] = []
        b = _transport(2, tmp_path, got)
        server, addr = await _serving(b, test_ca.security("node", 2), False)
        forged = _batch(1, 1) if claim == "batch" else _batch(3, 1)

        async def batches() -> AsyncIterator[raft_pb2.RaftBatch]:
            yield forged

        try:
            async with test_ca.security("node", 3).channel(addr) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await raft_pb2_grpc.RaftPeerStub(ch).Stream(batches(), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert got == [] and b.rejected == 1
            async with test_ca.security("node", 3).channel(addr) as ch:  # itself: fine

                async def honest() -> AsyncIterator[raft_pb2.RaftBatch]:
                    yield _batch(3, 3)

                await raft_pb2_grpc.RaftPeerStub(ch).Stream(honest(), timeout=10)
            assert [m.frm for m in got] == [3]
        finally:
            await b.close()
            await server.stop(None)

    run_bounded(body)


def test_a_client_certificate_may_not_speak_raft(
    tmp_path: Path, test_ca: ClusterCA, as_node_1: tls.Security
) -> None:
    async def body() -> None:
        got: list[Message] = []
        b = _transport(2, tmp_path, got)
        server, addr = await _serving(b, test_ca.security("node", 2), False)

        async def batches() -> AsyncIterator[raft_pb2.RaftBatch]:
            yield _batch(1, 1)

        try:
            async with test_ca.security("client").channel(addr) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await raft_pb2_grpc.RaftPeerStub(ch).Stream(batches(), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and got == []
        finally:
            await b.close()
            await server.stop(None)

    run_bounded(body)


async def _raw_tls(
    port: int, ctx: ssl.SSLContext | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    extra = {"ssl": ctx, "server_hostname": "127.0.0.1"} if ctx is not None else {}
    reader, writer = await asyncio.open_connection("127.0.0.1", port, **extra)  # type: ignore[arg-type]
    greeting = await asyncio.wait_for(reader.readexactly(len(MAGIC) + NONCE_BYTES), 5)
    return reader, writer, greeting[len(MAGIC) :]


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True


def _frame(b: raft_pb2.RaftBatch) -> bytes:
    data = b.SerializeToString()
    return struct.pack("<I", len(data)) + data


def test_a_framed_hello_must_name_the_node_of_the_certificate(
    tmp_path: Path, test_ca: ClusterCA, as_node_1: tls.Security
) -> None:
    """Node 3's certificate with a valid hello (it knows the secret) as node 1."""

    async def body() -> None:
        got: list[Message] = []
        b = _transport(2, tmp_path, got)
        server, _ = await _serving(b, test_ca.security("node", 2), True)
        assert b.frames is not None
        try:
            ctx = test_ca.creds("node", 3).client_ssl()
            reader, writer, nonce = await _raw_tls(b.frames.port, ctx)
            writer.write(_HELLO.pack(1, hello_mac(frames_key(SECRET, CLUSTER), CLUSTER, nonce, 1)))
            writer.write(_frame(_batch(1, 1)))
            await writer.drain()
            assert await _closed(reader)
            assert got == [] and b.rejected == 1
            writer.close()
            link = await FramesLink.connect("127.0.0.1", b.frames.port, CLUSTER, SECRET, 1)
            await link.send(_batch(1, 1).SerializeToString())  # as itself (node 1): taken
            await until(lambda: len(got) == 1, "node 1's own message")
            link.close()
        finally:
            await b.close()
            await server.stop(None)

    run_bounded(body)


@pytest.mark.parametrize("who", ["plaintext", "foreign CA", "no certificate"])
def test_strangers_are_refused_on_the_framed_links(
    tmp_path: Path, test_ca: ClusterCA, foreign_ca: ClusterCA, as_node_1: tls.Security, who: str
) -> None:
    async def body() -> None:
        rejected: list[int] = []
        server = frames.FramedServer(
            frames.WORK, CLUSTER, SECRET, lambda c: lambda f: None, lambda: rejected.append(1)
        )
        port = await server.start("127.0.0.1", 0)
        try:
            if who == "plaintext":
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"RLWORK01" + bytes(40))
                await writer.drain()
                assert await _closed(reader)
                writer.close()
            else:
                if who == "foreign CA":
                    ctx = foreign_ca.creds("node", 1).client_ssl()
                    ctx.load_verify_locations(cafile=str(test_ca.ca_file))  # it trusts us
                else:
                    ctx = tls.client_context(test_ca.ca_file)
                with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
                    await _raw_tls(port, ctx)
            assert not server.connections or all(c.peer_id == 0 for c in server.connections)
        finally:
            await server.close()

    run_bounded(body)


# ------------------------------------------------------------------ start-up


def _secret(tmp_path: Path) -> Path:
    s = tmp_path / "secret"
    s.write_text(os.urandom(32).hex())
    s.chmod(0o600)
    return s


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
        (dst / f.name).chmod(f.stat().st_mode & 0o777)
    return dst


@pytest.mark.parametrize("daemon", ["node", "queue"])
def test_daemons_refuse_to_start_without_credentials_or_with_an_open_key(
    tmp_path: Path, test_ca: ClusterCA, daemon: str
) -> None:
    cli = node_main.cli if daemon == "node" else queue_main.cli
    base = ["run", "--secret-file", str(_secret(tmp_path)), "--discovery-port", "0"]
    if daemon == "node":
        base += ["--node-id", "1", "--peers", "1=127.0.0.1:1", "--data-dir", str(tmp_path / "d")]
    r = CliRunner()
    res = r.invoke(cli, base)
    assert res.exit_code == 2 and "certs_dir: not set" in res.output, res.output
    src = test_ca.node(1) if daemon == "node" else test_ca.queue()
    certs = _copy(src, tmp_path / "certs")
    (certs / f"{daemon}.key").chmod(0o640)
    res = r.invoke(cli, [*base, "--certs-dir", str(certs)])
    assert res.exit_code == 2 and f"{daemon}.key: readable" in res.output, res.output
    assert "chmod 600" in res.output


def test_a_node_refuses_a_certificate_of_another_node_id(
    tmp_path: Path, test_ca: ClusterCA
) -> None:
    certs = _copy(test_ca.node(2), tmp_path / "certs")
    res = CliRunner().invoke(
        node_main.cli,
        ["run", "--secret-file", str(_secret(tmp_path)), "--discovery-port", "0",
         "--node-id", "1", "--peers", "1=127.0.0.1:1", "--data-dir", str(tmp_path / "d"),
         "--certs-dir", str(certs)],
    )  # fmt: skip
    assert res.exit_code == 2 and "names node 2" in res.output, res.output
