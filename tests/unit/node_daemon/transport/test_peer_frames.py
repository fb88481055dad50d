"""The framed peer link: frames split right however the bytes arrive, only an
authenticated peer of this cluster gets its messages through, bad input
closes the link without harm, and peers without frames are reached over the
gRPC stream as before."""

from __future__ import annotations

import asyncio
import os
import struct
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from node_daemon import metrics
from node_daemon.raft import Entry, Message, MessageType
from node_daemon.transport.peer_frames import (
    _HELLO,
    MAGIC,
    NONCE_BYTES,
    FramesLink,
    frames_key,
    hello_mac,
)
from node_daemon.transport.peer_transport import GroupEndpoint, PeerTransport
from roadlog.v1 import raft_pb2, raft_pb2_grpc
from tests.unit.node_daemon.transport.peer_transports import peer_transport
from tests.unit.support.loops import LOOPS, run_bounded, until, use_loop

pytestmark = pytest.mark.unit


async def no_snapshot(index: int, term: int) -> Path | None:
    """No snapshot here (these transports only receive)."""
    return None


SECRET = b"s" * 32
CLUSTER = "frames-test"


def _append(frm: int, to: int, index: int) -> Message:
    return Message(
        MessageType.APPEND,
        to,
        frm,
        term=3,
        index=index - 1,
        log_term=3,
        entries=(Entry(3, index, data=os.urandom(64)),),
        commit=index - 1,
    )


def _transport(node_id: int, tmp: Path, got: list[Message]) -> PeerTransport:
    return peer_transport(node_id, CLUSTER, SECRET, tmp, got)


async def _serving(t: PeerTransport, frames: bool) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    raft_pb2_grpc.add_RaftPeerServicer_to_server(t, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    if frames:
        assert await t.start_frames("127.0.0.1", 0) > 0
    return server, f"127.0.0.1:{port}"


@pytest.fixture(autouse=True, params=LOOPS)
def event_loop_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    return use_loop(request, monkeypatch)


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "grpc-fallback"])
def test_messages_flow_in_order_over_frames_or_the_grpc_stream(
    tmp_path: Path, frames: bool
) -> None:
    async def body() -> None:
        got_a: list[Message] = []
        got_b: list[Message] = []
        b = _transport(2, tmp_path, got_b)
        server, addr = await _serving(b, frames)
        a = _transport(1, tmp_path, got_a)
        a.set_addresses({2: addr})
        try:
            sent = [_append(1, 2, i) for i in range(1, 301)]
            for k in range(0, 300, 30):
                a.send(sent[k : k + 30])
                await asyncio.sleep(0)
            await until(lambda: len(got_b) == 300, "300 messages")
            assert got_b == sent  # every field, in order
            assert bool(b.frames and b.frames.connections) == frames
            assert b.rejected == 0
        finally:
            await a.close()
            await b.close()
            await server.stop(None)

    run_bounded(body)


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "grpc-fallback"])
def test_every_batch_tells_the_receiver_whether_the_senders_disk_is_low(
    tmp_path: Path, frames: bool
) -> None:
    """The disk bit (``peer_disk``) rides on both links, per sending node."""

    async def body() -> None:
        got_b: list[Message] = []
        b = _transport(2, tmp_path, got_b)
        server, addr = await _serving(b, frames)
        a = _transport(1, tmp_path, [])
        a.set_addresses({2: addr})
        try:
            assert b.peer_disks.low(1, time.monotonic()) is None  # not heard of yet
            a.send([_append(1, 2, 1)])
            await until(lambda: len(got_b) == 1, "the first message")
            assert b.peer_disks.low(1, time.monotonic()) is False
            a.disk_low = True
            a.send([_append(1, 2, 2)], group=0)
            await until(lambda: b.peer_disks.low(1, time.monotonic()) is True, "low said")
            a.disk_low = False
            a.send([_append(1, 2, 3)])
            await until(lambda: b.peer_disks.low(1, time.monotonic()) is False, "room again")
            assert len(got_b) == 3 and b.rejected == 0
        finally:
            await a.close()
            await b.close()
            await server.stop(None)

    run_bounded(body)


@pytest.mark.parametrize("frames", [True, False], ids=["frames", "grpc-fallback"])
def test_groups_share_one_link_and_each_message_reaches_its_group(
    tmp_path: Path, frames: bool
) -> None:
    """Several Raft groups on one node pair: what the groups send in one
    turn of the event loop goes out as one batch (one write), and the
    receiver routes each message to its own group; a message of a group
    the receiver does not run is dropped and counted, the rest arrive."""

    async def body() -> None:
        got: dict[int, list[Message]] = {0: [], 3: []}
        b = _transport(2, tmp_path, got[0])
        b.add_group(
            3,
            GroupEndpoint(
                got[3].append, lambda to: None, lambda to, ok: None, no_snapshot, tmp_path
            ),
        )
        with pytest.raises(ValueError):
            b.add_group(3, b.groups[3])
        server, addr = await _serving(b, frames)
        a = _transport(1, tmp_path, [])
        a.set_addresses({2: addr})
        try:
            a.send([_append(1, 2, 1)], group=0)
            await until(lambda: len(got[0]) == 1, "the link up")
            writes = metrics.PEER_STREAM_WRITES._value.get()
            to_0, to_3, to_9 = _append(1, 2, 2), _append(1, 2, 7), _append(1, 2, 9)
            a.send([to_0])  # group 0 by default
            a.sender(3)([to_3])
            a.send([to_9], group=9)  # b runs no group 9
            await until(lambda: len(got[0]) == 2 and len(got[3]) == 1, "both groups' messages")
            assert got[0][1] == to_0 and got[3] == [to_3]
            assert metrics.PEER_STREAM_WRITES._value.get() == writes + 1  # one batch for all
            await until(lambda: b.rejected == 1, "group 9's message counted as rejected")
        finally:
            await a.close()
            await b.close()
            await server.stop(None)

    run_bounded(body)


@pytest.mark.parametrize("takes", [True, False], ids=["coalesced", "older-receiver"])
def test_heartbeats_of_many_groups_go_coalesced_to_a_receiver_that_takes_them(
    tmp_path: Path, takes: bool
) -> None:
    """One turn's heartbeats and responses of several groups to one peer
    travel as coalesced beats of one batch (RaftBatch.beats) where the
    receiver said it takes them, else each as a RaftMessage (a node of an
    older version); either way each reaches its group as it was sent, and a
    heartbeat carrying what a beat cannot stays a RaftMessage."""

    async def body() -> None:
        got: dict[int, list[Message]] = {0: [], 1: [], 2: []}
        b = _transport(2, tmp_path, got[0])
        b.coalesce = takes
        for g in (1, 2):
            b.add_group(
                g,
                GroupEndpoint(
                    got[g].append, lambda to: None, lambda to, ok: None, no_snapshot, tmp_path
                ),
            )
        batches: list[raft_pb2.RaftBatch] = []
        receive = b._receive

        def recorded(batch: raft_pb2.RaftBatch) -> None:
            batches.append(batch)
            receive(batch)

        b._receive = recorded  # type: ignore[method-assign]
        server, addr = await _serving(b, True)
        a = _transport(1, tmp_path, [])
        a.set_addresses({2: addr})
        try:
            a.send([_append(1, 2, 1)], group=0)
            await until(lambda: len(got[0]) == 1, "the link up")
            beat = Message(MessageType.HEARTBEAT, 2, 1, 4, commit=9, context=b"r1", caught_up=3)
            resp = Message(MessageType.HEARTBEAT_RESP, 2, 1, 5, index=7, commit=6, catching_up=True)
            odd = Message(MessageType.HEARTBEAT, 2, 1, 4, log_term=2)  # no beat for it
            batches.clear()
            a.send([beat], group=0)
            a.sender(1)([resp])
            a.sender(2)([beat, odd])
            await until(
                lambda: len(got[0]) == 2 and len(got[1]) == 1 and len(got[2]) == 2,
                "every group's heartbeats",
            )
            # A group's beats reach it after its RaftMessages of the batch
            # (Raft takes messages in any order).
            assert got[0][1] == beat and got[1] == [resp]
            assert sorted(got[2], key=repr) == sorted([beat, odd], key=repr)
            assert len(batches) == 1  # one frame for all
            if takes:
                assert [(x.group, x.response) for x in batches[0].beats] == [
                    (0, False),
                    (1, True),
                    (2, False),
                ]
                assert [m.group for m in batches[0].messages] == [2]  # the odd one
            else:
                assert not batches[0].beats and len(batches[0].messages) == 4
        finally:
            await a.close()
            await b.close()
            await server.stop(None)

    run_bounded(body)


async def _raw_connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    greeting = await reader.readexactly(len(MAGIC) + NONCE_BYTES)
    assert greeting.startswith(MAGIC)
    return reader, writer, greeting[len(MAGIC) :]


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except ConnectionResetError:
        return True


def _batch(frm: int, cluster: str = CLUSTER, msg_from: int | None = None) -> bytes:
    m = raft_pb2.RaftMessage(type=int(MessageType.HEARTBEAT), to=2, term=1)
    setattr(m, "from", frm if msg_from is None else msg_from)
    b = raft_pb2.RaftBatch(cluster=cluster, messages=[m])
    setattr(b, "from", frm)
    data = b.SerializeToString()
    return struct.pack("<I", len(data)) + data


@pytest.mark.parametrize(
    "attack",
    ["wrong secret", "other cluster", "message from another node", "garbage frame", "huge frame"],
)
def test_a_bad_peer_is_cut_off_and_nothing_it_sent_reaches_raft(
    tmp_path: Path, attack: str
) -> None:
    async def body() -> None:
        got: list[Message] = []
        b = _transport(2, tmp_path, got)
        server, _ = await _serving(b, True)
        assert b.frames is not None
        try:
            reader, writer, nonce = await _raw_connect(b.frames.port)
            secret = b"x" * 32 if attack == "wrong secret" else SECRET
            writer.write(_HELLO.pack(1, hello_mac(frames_key(secret, CLUSTER), CLUSTER, nonce, 1)))
            if attack == "other cluster":
                writer.write(_batch(1, cluster="elsewhere"))
            elif attack == "message from another node":
                writer.write(_batch(1, msg_from=3))
            elif attack == "garbage frame":
                writer.write(struct.pack("<I", 5) + b"\xff\xff\xff\xff\xff")
            elif attack == "huge frame":
                writer.write(struct.pack("<I", 1 << 31))
            else:
                writer.write(_batch(1))
            await writer.drain()
            assert await _closed_by_server(reader)
            assert got == [] and b.rejected == 1
            writer.close()
            # The port still serves an honest peer afterwards.
            link = await FramesLink.connect("127.0.0.1", b.frames.port, CLUSTER, SECRET, 1)
            payload = _batch(1)[4:]
            await link.send(payload)
            await until(lambda: len(got) == 1, "the honest peer's message")
            assert got[0].frm == 1 and got[0].type == MessageType.HEARTBEAT
            link.close()
        finally:
            await b.close()
            await server.stop(None)

    run_bounded(body)


def test_a_link_to_a_dead_peer_breaks_and_the_sender_reconnects(tmp_path: Path) -> None:
    """A peer that restarts on the same port is reached again: the sender
    notices the broken link, drops what was queued, and dials anew."""

    async def body() -> None:
        got_b: list[Message] = []
        unreachable: list[int] = []
        b = _transport(2, tmp_path, got_b)
        server, addr = await _serving(b, True)
        assert b.frames is not None
        fport = b.frames.port
        a = _transport(1, tmp_path, [])
        a.groups[0] = replace(a.groups[0], on_unreachable=unreachable.append)
        a.set_addresses({2: addr})
        try:
            a.send([_append(1, 2, 1)])
            await until(lambda: len(got_b) == 1, "the first message")
            await b.close()  # the peer goes away (its gRPC server stays: the port is asked again)
            await until(lambda: 2 in unreachable, "the break noticed")
            got_b.clear()
            b2 = _transport(2, tmp_path, got_b)
            assert await b2.start_frames("127.0.0.1", fport) == fport
            b.frames = b2.frames  # what b's gRPC FramesEndpoint tells

            async def resend() -> bool:
                a.send([_append(1, 2, 2)])
                await asyncio.sleep(0.05)
                return bool(got_b)

            deadline = asyncio.get_running_loop().time() + 10
            while not await resend():
                assert asyncio.get_running_loop().time() < deadline, "never reconnected"
            assert got_b[0].entries[0].index == 2
        finally:
            await a.close()
            await b.close()
            await server.stop(None)

    run_bounded(body)


def test_a_flush_writes_to_an_idle_link_before_the_caller_goes_on(tmp_path: Path) -> None:
    """``flush`` sends what is queued in the caller's own turn of the event
    loop (a node calls it before an inline log write or apply, which would
    otherwise hold its append responses back); ``send`` alone leaves it for
    the next turn, so that what several groups send meanwhile shares a frame."""

    async def body() -> None:
        got: list[Message] = []
        b = _transport(2, tmp_path, got)
        server, addr = await _serving(b, frames=True)
        a = _transport(1, tmp_path, [])
        a.set_addresses({2: addr})
        try:
            a.send([_append(1, 2, 1)])
            await until(lambda: len(got) == 1, "the link up")
            await until(
                lambda: bool(a.peers) and all(p._idle_link for p in a.peers.values()), "idle"
            )
            writes = metrics.PEER_STREAM_WRITES._value.get()
            a.send([_append(1, 2, 2)])
            assert metrics.PEER_STREAM_WRITES._value.get() == writes  # queued only
            a.send([_append(1, 2, 3)])
            a.flush()  # no await between: written right here, both in one frame
            assert metrics.PEER_STREAM_WRITES._value.get() == writes + 1
            await until(lambda: len(got) == 3, "both messages")
            assert [m.index for m in got] == [0, 1, 2]
            assert metrics.PEER_STREAM_WRITES._value.get() == writes + 1  # nothing sent twice
        finally:
            await a.close()
            await b.close()
            await server.stop(None)

    run_bounded(body)
