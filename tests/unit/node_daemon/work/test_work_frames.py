"""The framed Work link between nodes and a queue server: work and answers
flow over it as over gRPC Pull (and over Pull where the queue server offers
no frames); only a node with the cluster's key gets in, it speaks only for
itself, and bad input cuts its link without losing the work it held."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from node_daemon.raft import ConfState, Role
from node_daemon.work import queue_link
from node_daemon.work.queue_link import QueueServerLink
from queue_server.config import QueueConfig
from queue_server.outgoing import Outgoing
from queue_server.queues import Item, Kind
from queue_server.server import QueueServer
from roadlog.limits import WORK_BATCH_BYTES
from roadlog.runtime import frames
from roadlog.runtime.auth import ClusterAuth, protects
from roadlog.v1 import client_pb2, work_pb2, work_pb2_grpc
from tests.unit.support.loops import LOOPS, run_bounded, until, use_loop

pytestmark = pytest.mark.unit

SECRET = b"w" * 32
CLUSTER = "roadlog"  # QueueConfig's default cluster name


@pytest.fixture(autouse=True, params=LOOPS)
def event_loop_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(queue_link, "node_status", lambda n, f=None: client_pb2.NodeStatus(id=n.id))
    return use_loop(request, monkeypatch)


class _Node:
    """What QueueServerLink reads of a Replica: a leader that applied 5."""

    def __init__(self, node_id: int) -> None:
        self.id = node_id
        self.cfg = SimpleNamespace(address=f"n{node_id}:1", cluster_name=CLUSTER)
        self.is_leader = True
        self.group = 0
        self.core = SimpleNamespace(
            role=Role.LEADER,
            lead=node_id,
            term=3,
            log=SimpleNamespace(committed=5),
            conf=ConfState(frozenset({node_id})),
            conf_index=1,
            catching_up=False,
        )
        self.sm = SimpleNamespace(applied_index=5)

    def address_of(self, node: int) -> str:
        return f"n{node}:1"


class _Echo:
    """A WorkHandler that answers each item with its own request, marked."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.ran: list[int] = []

    async def run(self, item: work_pb2.WorkItem) -> work_pb2.WorkResult:
        self.ran.append(item.id)
        return work_pb2.WorkResult(id=item.id, response=b"n%d:" % self.node_id + item.request)

    def reads_flowing(self, link: object, on: bool) -> None:
        pass


async def _queue_server(
    tmp_path: Path, frames_on: bool
) -> tuple[QueueServer, grpc.aio.Server, str]:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    qs = QueueServer(QueueConfig(secret_file=secret))
    server = grpc.aio.server(interceptors=[ClusterAuth(qs.token, protects(["roadlog.v1.Work"]))])
    work_pb2_grpc.add_WorkServicer_to_server(qs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    if frames_on:
        assert await qs.start_frames("127.0.0.1", 0) > 0
    return qs, server, f"127.0.0.1:{port}"


async def _stop(qs: QueueServer, server: grpc.aio.Server, *links: QueueServerLink) -> None:
    for link in links:
        await link.stop()
    if qs.frames is not None:
        await qs.frames.close()
    await server.stop(None)


def _link(addr: str, qs: QueueServer, node_id: int = 1) -> tuple[QueueServerLink, _Echo]:
    echo = _Echo(node_id)
    link = QueueServerLink(addr, _Node(node_id), echo, qs.token, SECRET)  # type: ignore[arg-type]
    link.start()
    return link, echo


@pytest.mark.parametrize("frames_on", [True, False], ids=["frames", "grpc-fallback"])
def test_work_and_answers_flow_over_frames_or_grpc_pull(tmp_path: Path, frames_on: bool) -> None:
    async def body() -> None:
        qs, server, addr = await _queue_server(tmp_path, frames_on)
        link, echo = _link(addr, qs)
        try:
            await until(lambda: bool(qs.q.workers), "the node connected")
            assert link.link_kind == ("frames" if frames_on else "grpc")
            calls = [qs.call("Publish", b"p%d" % i, 10.0, "c") for i in range(200)]
            calls += [qs.call("Fetch", b"", 10.0, "c") for _ in range(50)]
            answers = await asyncio.gather(*calls)
            assert answers[:200] == [b"n1:p%d" % i for i in range(200)]
            assert answers[200:] == [b"n1:"] * 50
            assert len(echo.ran) == 250
            [state] = qs.states.values()
            assert (state.node_id, state.is_leader, state.applied_index) == (1, True, 5)
            assert qs.frames_rejected == 0
        finally:
            await _stop(qs, server, link)

    run_bounded(body)


async def _raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    greeting = await reader.readexactly(len(frames.WORK.magic) + frames.NONCE_BYTES)
    assert greeting.startswith(frames.WORK.magic)
    return reader, writer, greeting[len(frames.WORK.magic) :]


def _hello(nonce: bytes, node_id: int, secret: bytes = SECRET) -> bytes:
    key = frames.WORK.key(secret, CLUSTER)
    return frames.HELLO.pack(node_id, frames.WORK.hello_mac(key, CLUSTER, nonce, node_id))


def _frame(msg: Any) -> bytes:
    data = msg if isinstance(msg, bytes) else msg.SerializeToString()
    return struct.pack("<I", len(data)) + data


def _leader_state(node_id: int) -> work_pb2.WorkerMessage:
    return work_pb2.WorkerMessage(
        state=work_pb2.WorkerState(node_id=node_id, is_leader=True, term=3, applied_index=5),
        credit=work_pb2.Credit(writes=10, reads=10),
    )


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (reads to its end)."""
    try:
        while await asyncio.wait_for(reader.read(1 << 16), 10):
            pass
    except ConnectionError:
        pass
    return True


@pytest.mark.parametrize(
    "attack",
    ["wrong key", "node id 0", "speaks for another node", "frame over the limit"],
)
def test_intruders_are_cut_off_and_counted_with_nothing_reaching_the_queues(
    tmp_path: Path, attack: str
) -> None:
    async def body() -> None:
        qs, server, addr = await _queue_server(tmp_path, True)
        assert qs.frames is not None
        try:
            reader, writer, nonce = await _raw(qs.frames.port)
            if attack == "wrong key":
                writer.write(_hello(nonce, 1, b"x" * 32) + _frame(_leader_state(1)))
            elif attack == "node id 0":
                writer.write(_hello(nonce, 0) + _frame(_leader_state(0)))
            elif attack == "speaks for another node":
                writer.write(_hello(nonce, 7) + _frame(_leader_state(8)))
            else:
                writer.write(_hello(nonce, 1) + struct.pack("<I", frames.WORK.max_frame + 1))
            assert await _closed(reader)
            writer.close()
            await until(lambda: qs.frames_rejected == 1, "the refusal counted")
            assert not qs.q.workers and not qs.states
            # The port still serves an honest node.
            link, _ = _link(addr, qs)
            try:
                assert await qs.call("Fetch", b"", 10.0, "c") == b"n1:"
                assert link.link_kind == "frames"
            finally:
                await link.stop()
        finally:
            await _stop(qs, server)

    run_bounded(body)


def test_garbage_cuts_a_link_and_its_work_goes_to_another_node(tmp_path: Path) -> None:
    async def body() -> None:
        qs, server, addr = await _queue_server(tmp_path, True)
        assert qs.frames is not None
        try:
            reader, writer, nonce = await _raw(qs.frames.port)
            writer.write(_hello(nonce, 1) + _frame(_leader_state(1)))
            read = asyncio.ensure_future(qs.call("Fetch", b"", 20.0, "c"))
            # The read reaches the raw node (after the FenceWait first word).
            got = b""
            while b"Fetch" not in got:
                got += await asyncio.wait_for(reader.read(1 << 16), 10)
            writer.write(_frame(b"\xff\xff\xff"))  # not a WorkerMessage
            assert await _closed(reader)
            writer.close()
            assert qs.frames_rejected == 1
            assert not read.done()
            link, echo = _link(addr, qs, node_id=2)
            try:
                assert await read == b"n2:"  # requeued, not lost
                assert len(echo.ran) == 1
            finally:
                await link.stop()
        finally:
            await _stop(qs, server)

    run_bounded(body)


def test_a_node_reconnects_when_the_queue_server_cuts_its_link(tmp_path: Path) -> None:
    async def body() -> None:
        qs, server, addr = await _queue_server(tmp_path, True)
        fs = qs.frames
        assert fs is not None
        link, _ = _link(addr, qs)
        try:
            await until(lambda: len(fs.connections) == 1, "a framed link")
            [conn] = fs.connections
            conn.abort()
            await until(
                lambda: len(fs.connections) == 1 and conn not in fs.connections,
                "a new framed link",
            )
            assert await qs.call("Publish", b"again", 10.0, "c") == b"n1:again"
        finally:
            await _stop(qs, server, link)

    run_bounded(body)


def test_work_goes_out_as_workitems_wire_bytes_with_the_newest_fence_wait(
    tmp_path: Path,
) -> None:
    """What a node is sent is WorkItems (parsed from the joined parts): the
    requests whole, a request over WORK_BATCH_BYTES alone, and only the
    newest FenceWait of those queued (an empty one, "none", included)."""

    async def body() -> list[work_pb2.WorkItems]:
        secret = tmp_path / "secret"
        secret.write_bytes(SECRET)
        secret.chmod(0o600)
        qs = QueueServer(QueueConfig(secret_file=secret))
        wid = qs._open_session(1)
        out = qs._sessions[wid]
        out.get_nowait()  # the session's first FenceWait
        big = b"B" * (WORK_BATCH_BYTES + 1)
        for i, req in enumerate([b"a", b"", big, b"c"], start=1):
            it = Item(i, Kind.WRITE, "Publish", req, 12.5, 0.0, 0, client="c")
            out.put_nowait(Outgoing.of(it, 10.0))  # handed out with 2.5 s left
            if i == 1:
                out.put_nowait(work_pb2.FenceWait(index=9, reads=True))
                out.put_nowait(work_pb2.FenceWait())  # newer: none waits
        out.put_nowait(None)
        return [work_pb2.WorkItems.FromString(b"".join(parts)) async for parts in qs._batches(wid)]

    sent = asyncio.run(body())
    assert [[(i.id, i.request) for i in b.items] for b in sent] == [
        [(1, b"a"), (2, b"")],
        [(3, b"B" * (WORK_BATCH_BYTES + 1))],
        [(4, b"c")],
    ]
    assert sent[0].HasField("fence_wait") and sent[0].fence_wait == work_pb2.FenceWait()
    assert not sent[1].HasField("fence_wait") and not sent[2].HasField("fence_wait")
    first = sent[0].items[0]
    assert (first.kind, first.method, first.budget_ms) == (
        work_pb2.WORK_KIND_WRITE,
        "Publish",
        2500,
    )
    assert abs(first.deadline_unix_ms - (time.time() + 2.5) * 1000) < 60_000


def test_a_frames_port_already_taken_means_nodes_pull_over_grpc(tmp_path: Path) -> None:
    async def body() -> None:
        qs, server, addr = await _queue_server(tmp_path, False)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            assert await qs.start_frames("127.0.0.1", taken.getsockname()[1]) == 0
        assert qs.frames is None
        link, _ = _link(addr, qs)
        try:
            assert await qs.call("Publish", b"p", 10.0, "c") == b"n1:p"
            assert link.link_kind == "grpc"
        finally:
            await _stop(qs, server, link)

    run_bounded(body)
