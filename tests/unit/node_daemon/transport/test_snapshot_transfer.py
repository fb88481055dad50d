"""Snapshot transfer over real gRPC on loopback: a corrupt chunk and a
broken stream are asked for again, and only a verified file is handed on."""

from __future__ import annotations

import asyncio
import os
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from node_daemon.transport.peer_transport import CHUNK, PeerTransport, file_sha256
from roadlog.v1 import raft_pb2, raft_pb2_grpc

pytestmark = pytest.mark.unit


async def no_snapshot(index: int, term: int) -> Path | None:
    """No snapshot here (these transports only receive)."""
    return None


class FlakySender(raft_pb2_grpc.RaftPeerServicer):
    """Serves a snapshot file, corrupting one chunk once and cutting the
    stream once, as a bad network would."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sha = file_sha256(path)
        self.corrupted = False
        self.cut = False
        self.requests: list[int] = []

    async def Stream(self, request_iterator: Any, context: Any) -> raft_pb2.StreamClosed:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")
        return raft_pb2.StreamClosed()

    async def FramesEndpoint(
        self, request: raft_pb2.FramesEndpointRequest, context: Any
    ) -> raft_pb2.FramesEndpointReply:
        return raft_pb2.FramesEndpointReply(port=0)

    async def FetchSnapshot(
        self, request: raft_pb2.SnapshotRequest, context: Any
    ) -> AsyncIterator[raft_pb2.SnapshotChunk]:
        self.requests.append(request.offset)
        call = len(self.requests)  # this call's own number: an abandoned call may run on
        data = self.path.read_bytes()
        offset = request.offset
        while offset < len(data):
            chunk = data[offset : offset + CHUNK]
            crc = zlib.crc32(chunk)
            if call == 1 and offset >= CHUNK and not self.corrupted:
                self.corrupted = True
                chunk = b"\x00" + chunk[1:]  # flipped on the wire; the CRC still says the truth
            if call == 2 and offset >= 2 * CHUNK and not self.cut:
                self.cut = True
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
            yield raft_pb2.SnapshotChunk(
                offset=offset, data=chunk, crc32=crc, total_size=len(data), sha256=self.sha
            )
            offset += CHUNK


def test_a_corrupt_chunk_and_a_broken_stream_are_fetched_again(tmp_path: Path) -> None:
    src = tmp_path / "snap.mdb"
    src.write_bytes(os.urandom(3 * CHUNK + 12345))

    async def run() -> tuple[Path | None, FlakySender]:
        sender = FlakySender(src)
        server = grpc.aio.server()
        raft_pb2_grpc.add_RaftPeerServicer_to_server(sender, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            receiver = PeerTransport(
                2,
                "test",
                b"secret",
                tmp_path / "recv",
                on_message=lambda m: None,
                on_unreachable=lambda n: None,
                on_snapshot_status=lambda n, ok: None,
                snapshot_file=no_snapshot,
            )
            receiver.set_addresses({1: f"127.0.0.1:{port}"})
            got = await receiver.fetch_snapshot(1, index=7, term=3)
            return got, sender
        finally:
            await server.stop(None)

    got, sender = asyncio.run(run())
    assert got is not None
    assert got.read_bytes() == src.read_bytes()
    assert sender.corrupted and sender.cut
    # It resumed from the last good offset instead of starting over.
    assert sender.requests[0] == 0 and all(r > 0 for r in sender.requests[1:])
    assert len(sender.requests) >= 3
    assert not list((tmp_path / "recv").glob("*.part"))
