"""The gRPC peer transport: one long-lived stream to each peer, and snapshot
transfer in checksummed chunks that resumes where it broke.

Sending never blocks the node: messages go into a bounded queue per peer and
a task streams them; when a peer is unreachable its messages are dropped
(Raft retries) and the node is told, so the leader stops streaming to it.

A SNAPSHOT message travels with its metadata only. The receiver then pulls
the snapshot file from the sender with FetchSnapshot, checks every chunk's
CRC-32 and the whole file's SHA-256, asks again from the last good offset
when a chunk is bad or the stream breaks, and only then hands the message
(with the local file's path as its data) to its Raft core.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from node_daemon import metrics
from node_daemon.raft import Message, MessageType
from node_daemon.wire import message_from_pb, message_to_pb
from roadlog.runtime.auth import cluster_token, token_metadata
from roadlog.v1 import raft_pb2, raft_pb2_grpc

log = logging.getLogger("roadlog.transport")

CHUNK = 1 << 20
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
QUEUE_LIMIT = 4096
BATCH_BYTES = 8 << 20  # entry bytes per stream message (the receiver takes up to 64 MiB)


# Counter children made once: labels() on every message would cost more than the count.
_SENT_BY_TYPE = {t: metrics.PEER_MESSAGES_SENT.labels(t.name.lower()) for t in MessageType}


def _payload(m: Message) -> int:
    return sum(len(e.data) for e in m.entries) if m.entries else 0


# A receiver starts pulling a snapshot within moments of its message; if no
# pull has started by then, the message was lost: tell Raft, which resends.
SNAPSHOT_START_TIMEOUT_S = 5.0


def file_sha256(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.digest()


class _Peer:
    def __init__(self, transport: PeerTransport, node_id: int, address: str) -> None:
        self.t = transport
        self.id = node_id
        self.address = address
        self.queue: asyncio.Queue[Message] = asyncio.Queue(QUEUE_LIMIT)
        self.up = False
        self.task = asyncio.get_running_loop().create_task(self._run())

    def put(self, m: Message) -> None:
        try:
            self.queue.put_nowait(m)
        except asyncio.QueueFull:
            self.t.dropped += 1

    async def _batches(self) -> AsyncIterator[raft_pb2.RaftBatch]:
        while True:
            first = await self.queue.get()
            if not self.up:
                self.up = True
                log.info("peer stream up", extra={"peer": self.id})
            batch = raft_pb2.RaftBatch(cluster=self.t.cluster, messages=[message_to_pb(first)])
            setattr(batch, "from", self.t.node_id)
            size = _payload(first)
            # Bounded in count and bytes: a catching-up follower is sent up to
            # 64 MiB of APPENDs at once, and a stream message past the
            # receiver's limit would break the stream and start over.
            _SENT_BY_TYPE[first.type].inc()
            while not self.queue.empty() and len(batch.messages) < 512 and size < BATCH_BYTES:
                m = self.queue.get_nowait()
                size += _payload(m)
                batch.messages.append(message_to_pb(m))
                _SENT_BY_TYPE[m.type].inc()
            metrics.PEER_STREAM_WRITES.inc()
            yield batch

    async def _run(self) -> None:
        # One channel for the peer's lifetime, reconnecting fast: a channel
        # made while the peer was down would otherwise back off for seconds
        # after it came back, and elections would wait for it.
        async with grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS) as ch:
            await self._stream_forever(ch)

    async def _stream_forever(self, ch: grpc.aio.Channel) -> None:
        stub = raft_pb2_grpc.RaftPeerStub(ch)
        backoff = 0.02
        while True:
            started = time.monotonic()
            try:
                await stub.Stream(
                    self._batches(), metadata=token_metadata(self.t.token), wait_for_ready=True
                )
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                if self.up:
                    log.info("peer stream down", extra={"peer": self.id, "code": e.code().name})
            except Exception:
                log.exception("peer stream failed", extra={"peer": self.id})
            self.up = False
            if time.monotonic() - started > 1.0:
                backoff = 0.02  # it was working: retry soon
            # Whatever was queued is stale now: drop it, tell Raft, retry.
            while not self.queue.empty():
                if self.queue.get_nowait().type == MessageType.SNAPSHOT:
                    self.t._snapshot_lost(self.id)
                self.t.dropped += 1
            self.t.on_unreachable(self.id)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.2)


class PeerTransport(raft_pb2_grpc.RaftPeerServicer):
    def __init__(
        self,
        node_id: int,
        cluster: str,
        secret: bytes,
        snapshot_dir: Path,
        on_message: Callable[[Message], None],
        on_unreachable: Callable[[int], None],
        on_snapshot_status: Callable[[int, bool], None],
        snapshot_file: Callable[[int, int], Path | None],
    ) -> None:
        self.node_id = node_id
        self.cluster = cluster
        self.token = cluster_token(secret, cluster)
        self.snapshot_dir = snapshot_dir
        self.on_message = on_message
        self.on_unreachable = on_unreachable
        self.on_snapshot_status = on_snapshot_status
        self.snapshot_file = snapshot_file
        self.peers: dict[int, _Peer] = {}
        self.addresses: dict[int, str] = {}
        self.dropped = 0
        self.rejected = 0
        self._snapshot_timers: dict[int, asyncio.TimerHandle] = {}
        self._fetching: set[tuple[int, int]] = set()
        self._sha_cache: dict[Path, bytes] = {}

    def set_addresses(self, addresses: dict[int, str]) -> None:
        for nid, addr in addresses.items():
            if nid == self.node_id:
                continue
            old = self.peers.get(nid)
            if old is not None and old.address != addr:
                old.task.cancel()
                del self.peers[nid]
            self.addresses[nid] = addr

    def send(self, msgs: list[Message]) -> None:
        for m in msgs:
            peer = self.peers.get(m.to)
            if peer is None:
                addr = self.addresses.get(m.to)
                if addr is None:
                    self.dropped += 1
                    continue
                peer = self.peers[m.to] = _Peer(self, m.to, addr)
            if m.type == MessageType.SNAPSHOT:
                self._arm_snapshot_timer(m.to)
            peer.put(m)

    def _snapshot_lost(self, to: int) -> None:
        self._snapshot_timers.pop(to, None)
        log.info("snapshot not pulled; Raft will send it again", extra={"peer": to})
        self.on_snapshot_status(to, False)

    def _arm_snapshot_timer(self, to: int) -> None:
        old = self._snapshot_timers.pop(to, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._snapshot_timers[to] = loop.call_later(
            SNAPSHOT_START_TIMEOUT_S, self._snapshot_lost, to
        )

    async def close(self) -> None:
        for p in self.peers.values():
            p.task.cancel()
        for p in self.peers.values():
            with contextlib.suppress(asyncio.CancelledError):
                await p.task
        for t in self._snapshot_timers.values():
            t.cancel()

    # ------------------------------------------------------------- serving

    async def Stream(
        self,
        request_iterator: AsyncIterator[raft_pb2.RaftBatch],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> raft_pb2.StreamClosed:
        async for batch in request_iterator:  # the cluster token is checked by ClusterAuth
            if batch.cluster != self.cluster:
                self.rejected += 1
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "foreign cluster")
            for pb in batch.messages:
                try:
                    if pb.has_snapshot:
                        self._start_fetch(pb)
                    else:
                        self.on_message(message_from_pb(pb))
                except ValueError:
                    self.rejected += 1
        return raft_pb2.StreamClosed()

    async def FetchSnapshot(
        self, request: raft_pb2.SnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[raft_pb2.SnapshotChunk]:
        if request.cluster != self.cluster:  # the cluster token is checked by ClusterAuth
            self.rejected += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad cluster credentials")
        timer = self._snapshot_timers.pop(request.node_id, None)
        if timer is not None:
            timer.cancel()  # the pull started: its end decides
        path = self.snapshot_file(request.index, request.term)
        if path is None or not path.exists():
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such snapshot here any more")
            return
        loop = asyncio.get_running_loop()
        sha = self._sha_cache.get(path)
        if sha is None:
            sha = self._sha_cache[path] = await loop.run_in_executor(None, file_sha256, path)
        size = path.stat().st_size
        offset = request.offset
        ok = False
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                while offset < size:
                    data = await loop.run_in_executor(None, f.read, CHUNK)
                    yield raft_pb2.SnapshotChunk(
                        offset=offset,
                        data=data,
                        crc32=zlib.crc32(data),
                        total_size=size,
                        sha256=sha,
                    )
                    offset += len(data)
            ok = True
        finally:
            self.on_snapshot_status(request.node_id, ok)

    # ----------------------------------------------------- receiving a snapshot

    def _start_fetch(self, pb: raft_pb2.RaftMessage) -> None:
        key = (pb.snapshot.index, pb.snapshot.term)
        if key in self._fetching:
            return
        self._fetching.add(key)
        asyncio.get_running_loop().create_task(self._fetch(pb, key))

    async def _fetch(self, pb: raft_pb2.RaftMessage, key: tuple[int, int]) -> None:
        sender = getattr(pb, "from")
        t0 = time.monotonic()
        log.info("pulling snapshot", extra={"from": sender, "index": key[0]})
        try:
            path = await self.fetch_snapshot(sender, *key)
            if path is not None:
                log.info(
                    "snapshot received",
                    extra={
                        "from": sender,
                        "index": key[0],
                        "bytes": path.stat().st_size,
                        "seconds": round(time.monotonic() - t0, 3),
                    },
                )
                self.on_message(message_from_pb(pb, str(path).encode()))
        except Exception:
            log.exception("snapshot fetch failed", extra={"from": sender, "index": key[0]})
        finally:
            self._fetching.discard(key)

    async def fetch_snapshot(
        self, sender: int, index: int, term: int, attempts: int = 5
    ) -> Path | None:
        """Download a snapshot, verified; resumes after a broken stream or a
        bad chunk. Returns the local path, or None if it could not be had."""
        addr = self.addresses.get(sender)
        if addr is None:
            return None
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        dest = self.snapshot_dir / f"recv-{index}-{term}.mdb"
        part = dest.with_suffix(".part")
        offset = part.stat().st_size if part.exists() else 0
        for attempt in range(attempts):
            sha, total = b"", -1
            try:
                opts = [("grpc.max_receive_message_length", 8 << 20)]
                async with grpc.aio.insecure_channel(addr, options=opts) as ch:
                    stub = raft_pb2_grpc.RaftPeerStub(ch)
                    req = raft_pb2.SnapshotRequest(
                        cluster=self.cluster,
                        index=index,
                        term=term,
                        offset=offset,
                        node_id=self.node_id,
                    )
                    md = token_metadata(self.token)
                    with open(part, "ab") as f:
                        async for chunk in stub.FetchSnapshot(req, metadata=md):
                            sha, total = chunk.sha256, chunk.total_size
                            if chunk.offset != offset or zlib.crc32(chunk.data) != chunk.crc32:
                                log.warning(
                                    "bad snapshot chunk; asking again",
                                    extra={"offset": offset, "attempt": attempt},
                                )
                                break
                            f.write(chunk.data)
                            offset += len(chunk.data)
                        f.flush()
                        os.fsync(f.fileno())
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    part.unlink(missing_ok=True)
                    return None
                await asyncio.sleep(0.1 * (attempt + 1))
                continue
            if total >= 0 and offset >= total:
                loop = asyncio.get_running_loop()
                if await loop.run_in_executor(None, file_sha256, part) == sha:
                    os.replace(part, dest)
                    return dest
                part.unlink(missing_ok=True)  # complete but wrong: start over
                offset = 0
        part.unlink(missing_ok=True)
        return None
