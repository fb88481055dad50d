"""The peer transport: one long-lived link to each peer, and snapshot
transfer in checksummed chunks that resumes where it broke.

A link is the framed peer link (``peer_frames``: length-prefixed batches on
plain TCP, run by the event loop) where the peer offers one, which it says
through gRPC's ``FramesEndpoint``; otherwise (frames off, or a peer of an
older version) the gRPC stream ``RaftPeer.Stream``. Both carry the same
``RaftBatch`` messages; snapshots always travel over gRPC.

Sending never blocks the node: messages go into a bounded queue per peer and
a task streams them; when a peer is unreachable its messages are dropped
(Raft retries) and the node is told, so the leader stops streaming to it.

One transport serves every Raft group the process runs (docs/multiraft.md):
each group registers a ``GroupEndpoint`` and sends with its group's number;
every message carries it (``RaftMessage.group``, 0 for the metadata group,
so a one-group node's wire is as before), and the receiver routes each
message to its group. All groups' messages to one peer share its queue, so
what the groups send in one turn of the event loop (their heartbeats of one
tick, above all) leaves in one batch: one frame, one write. In that frame
the heartbeats and their responses are coalesced (CockroachDB's coalesced
heartbeats): one small ``GroupBeat`` each in ``RaftBatch.beats`` instead of
a ``RaftMessage``, fanned out to their groups by the receiver, sent only
to a process that says in ``FramesEndpoint`` it takes them
(``coalesced_heartbeats``; a node of an older version does not, and gets
each heartbeat as a RaftMessage, as before).

Every batch also says whether its sender's disk is low (``disk_low``, set
by the process's groups); the receiver keeps what each peer said last, with
when (``peer_disks``, ``node_daemon.transport.peer_disk``). And the
operation kinds its release applies (``op_level``; ``peer_op_levels``:
each peer's last word, which group 0's leader reads before it proposes a
newer kind, node_daemon/state/op_gate.py).

A node may run some groups in other processes (worker processes,
docs/multiraft.md step 5), each with its own gRPC and framed ports. Its
main process says which in ``FramesEndpointReply.group_ports`` (group ->
that process's gRPC port on the same host), and a sender learns the map
from every peer (``routes``) and sends each group's messages, and pulls its
snapshots, at the port that runs the group: one link per peer process, so
the groups of one worker pair still share theirs. A group a peer did not
name goes to its main address (group 0 always; every group of a node of
one process). The map is asked again whenever a link to the peer breaks:
a worker that restarted may listen elsewhere.

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
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from node_daemon import metrics
from node_daemon.raft import Message, MessageType
from node_daemon.storage.disk import fsync_dir
from node_daemon.transport.batch_wire import encode_batch
from node_daemon.transport.peer_disk import PeerDisks
from node_daemon.transport.peer_frames import FormatRefused, FramesLink, FramesServer, Greetings
from node_daemon.transport.wire import message_from_pb, message_of_beat, message_to_pb
from roadlog import round_trace
from roadlog.runtime import tls
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


def received_path(directory: Path, index: int, term: int) -> Path:
    """Where a snapshot pulled from the leader is kept (the transport
    writes it; the log names it once installed)."""
    return directory / f"recv-{index}-{term}.mdb"


def _payload(m: Message) -> int:
    return sum(len(e.data) for e in m.entries) if m.entries else 0


Outgoing = tuple[int, Message]  # (Raft group, message)

ROUTES_RETRY_S = 1.0  # at most one ask for a peer's group ports per peer this often
# A peer that shares no frame format with us (peer_frames' greeting) is
# asked again this often, not at the reconnect's pace.
FORMAT_REFUSED_RETRY_S = 5.0


def with_port(address: str, port: int) -> str:
    """``address`` ("host:port", "[v6]:port") with another port."""
    return f"{address.rpartition(':')[0]}:{port}"


@dataclass(frozen=True)
class GroupEndpoint:
    """What the transport needs from one Raft group of this node: where its
    messages go, whom to tell of an unreachable peer or a snapshot's fate,
    and where its snapshots are (sent from, and received into)."""

    on_message: Callable[[Message], None]
    on_unreachable: Callable[[int], None]
    on_snapshot_status: Callable[[int, bool], None]
    snapshot_file: Callable[[int, int], Awaitable[Path | None]]
    snapshot_dir: Path


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
    """The sending side of the link to one peer: a bounded queue of messages
    and a task that keeps a link up and drains the queue into it."""

    def __init__(self, transport: PeerTransport, node_id: int, address: str) -> None:
        self.t = transport
        self.id = node_id
        self.address = address  # the peer's main address, or one of its workers'
        self.pending: deque[Outgoing] = deque()
        self.ready = asyncio.Event()  # set when pending has messages (or a link broke)
        self.up = False
        # The framed link while this peer's task waits for messages on it:
        # ``flush`` writes to it at once (see there).
        self._idle_link: FramesLink | None = None
        # The process at ``address`` takes coalesced heartbeats on the
        # framed link (it said so in FramesEndpoint).
        self.beats = False
        self.format = 0  # the frame format agreed in the greeting (0: none yet)
        self.task = asyncio.get_running_loop().create_task(self._run())

    def put(self, group: int, m: Message) -> None:
        """Queue ``m``; it leaves with the next ``flush``."""
        if len(self.pending) >= QUEUE_LIMIT:
            self.t.dropped += 1
            return
        self.pending.append((group, m))

    def flush(self) -> None:
        """Send what is queued, as one batch: written to the framed link
        right here while the link is up and its task waits for messages
        (no wake-up of the task); otherwise (no link yet, the gRPC stream,
        a full socket buffer, a send under way) the task is woken to send
        it, in order."""
        if not self.pending:
            return
        link = self._idle_link
        if link is not None and link.writable:
            self._mark_up("frames")
            round_trace.mark("peer_out")
            link.write_parts(self._next_frame())
            if not self.pending:
                return
        self.ready.set()

    def _mark_up(self, how: str) -> None:
        if not self.up:
            self.up = True
            log.info("peer stream up", extra={"peer": self.id, "link": how})

    def _next_messages(self) -> list[Outgoing]:
        """What is pending (of any group), as one batch bounded in count and
        bytes: a catching-up follower is sent up to 64 MiB of APPENDs at
        once, and a message past the receiver's limit would break the link."""
        pending = self.pending
        first = pending.popleft()
        out = [first]
        size = _payload(first[1])
        _SENT_BY_TYPE[first[1].type].inc()
        while pending and len(out) < 512 and size < BATCH_BYTES:
            gm = pending.popleft()
            size += _payload(gm[1])
            out.append(gm)
            _SENT_BY_TYPE[gm[1].type].inc()
        metrics.PEER_STREAM_WRITES.inc()
        return out

    def _next_frame(self) -> list[bytes]:
        """The pending messages as one framed link frame's parts."""
        t = self.t
        return encode_batch(
            t.cluster, t.node_id, self._next_messages(), t.disk_low, self.beats, t.op_level
        )

    def _next_batch(self) -> raft_pb2.RaftBatch:
        """The pending messages as one RaftBatch (for the gRPC stream)."""
        batch = raft_pb2.RaftBatch(
            cluster=self.t.cluster,
            messages=[message_to_pb(m, g) for g, m in self._next_messages()],
            disk_low=self.t.disk_low,
            op_level=self.t.op_level,
        )
        setattr(batch, "from", self.t.node_id)
        return batch

    async def _wait_pending(self, link: FramesLink | None = None) -> None:
        """Until a message is pending (or ``link`` is down)."""
        while not self.pending and not (link is not None and link.closed):
            self.ready.clear()
            await self.ready.wait()

    async def _batches(self) -> AsyncIterator[raft_pb2.RaftBatch]:
        while True:
            await self._wait_pending()
            self._mark_up("grpc")
            yield self._next_batch()

    async def _run(self) -> None:
        # One channel for the peer's lifetime, reconnecting fast: a channel
        # made while the peer was down would otherwise back off for seconds
        # after it came back, and elections would wait for it.
        async with tls.current().channel(self.address, options=CHANNEL_OPTIONS) as ch:
            await self._link_forever(ch)

    async def _frames_port(self, stub: raft_pb2_grpc.RaftPeerAsyncStub) -> int:
        """The peer's framed link port (0: it offers none)."""
        self.beats = False
        if not self.t.use_frames:
            return 0
        try:
            reply = await stub.FramesEndpoint(
                self.t.greetings.request(),
                metadata=token_metadata(self.t.token),
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return 0  # a peer of an older version: its gRPC stream
            raise
        try:
            self.format = self.t.greetings.agree(self.id, reply)
        except FormatRefused as e:  # logged; asked again later, never a crash
            await asyncio.sleep(FORMAT_REFUSED_RETRY_S)
            raise ConnectionError(f"no common frame format: {e}") from None
        self.beats = bool(reply.port) and reply.coalesced_heartbeats and self.t.coalesce
        return int(reply.port)

    async def _frames(self, port: int) -> None:
        """Drain the queue into a framed link until the link breaks."""
        host = self.address.rpartition(":")[0].strip("[]")
        link = await FramesLink.connect(host, port, self.t.cluster, self.t.secret, self.t.node_id)
        broke = asyncio.get_running_loop().create_task(link.wait_closed())
        broke.add_done_callback(lambda _: self.ready.set())
        try:
            while True:
                self._idle_link = link
                try:
                    await self._wait_pending(link)
                finally:
                    self._idle_link = None
                if link.closed:
                    raise ConnectionError("frames link is down")
                self._mark_up("frames")
                await link.send_parts(self._next_frame())
        finally:
            broke.cancel()
            link.close()

    async def _link_forever(self, ch: grpc.aio.Channel) -> None:
        stub = raft_pb2_grpc.RaftPeerStub(ch)
        backoff = 0.02
        while True:
            started = time.monotonic()
            try:
                port = await self._frames_port(stub)
                if port:
                    await self._frames(port)
                else:
                    await stub.Stream(
                        self._batches(), metadata=token_metadata(self.t.token), wait_for_ready=True
                    )
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                if self.up:
                    log.info("peer stream down", extra={"peer": self.id, "code": e.code().name})
            except OSError as e:  # ConnectionError and TimeoutError too
                if self.up:
                    log.info("peer stream down", extra={"peer": self.id, "error": repr(e)})
            except Exception:
                log.exception("peer stream failed", extra={"peer": self.id})
            self.up = False
            self.t._ask_routes(self.id)  # a worker of the peer may have moved
            if time.monotonic() - started > 1.0:
                backoff = 0.02  # it was working: retry soon
            # Whatever was queued is stale now: drop it, tell Raft, retry.
            while self.pending:
                group, m = self.pending.popleft()
                if m.type == MessageType.SNAPSHOT:
                    self.t._snapshot_lost(group, self.id)
                self.t.dropped += 1
            self.t._unreachable(self.id, self.address)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.2)


def _no_message(m: Message) -> None:
    pass


def _no_peer(to: int) -> None:
    pass


def _no_status(to: int, ok: bool) -> None:
    pass


async def _no_file(index: int, term: int) -> Path | None:
    return None


def _certified_node(context: Any) -> int:
    """The node id the caller's certificate names (0: no TLS, so no binding;
    with TLS, CertAuth lets only node certificates reach RaftPeer)."""
    ident = tls.grpc_identity(context)
    return ident.node_id if ident is not None else 0


def _all_from(batch: raft_pb2.RaftBatch, sender: int) -> bool:
    """Every message of ``batch`` (and the batch) says it is from ``sender``."""
    return getattr(batch, "from") == sender and all(
        getattr(m, "from") == sender for m in batch.messages
    )


class PeerTransport(raft_pb2_grpc.RaftPeerServicer):
    """The links of one process to its peers, for every Raft group it runs.

    Invariants: a message goes to the process that runs its group on the
    peer as far as this transport knows (``routes``; the peer's main
    address otherwise); one ``_Peer`` (one link, one queue) per peer
    process; a message of a group this process does not run is dropped
    and counted, never handed to another group."""

    def __init__(
        self,
        node_id: int,
        cluster: str,
        secret: bytes,
        snapshot_dir: Path,
        on_message: Callable[[Message], None],
        on_unreachable: Callable[[int], None],
        on_snapshot_status: Callable[[int, bool], None],
        snapshot_file: Callable[[int, int], Awaitable[Path | None]],
    ) -> None:
        """A transport with group 0's endpoint (``bare`` for one without)."""
        self.node_id = node_id
        self.cluster = cluster
        self.token = cluster_token(secret, cluster)
        self.secret = secret
        self.use_frames = True  # dial peers' framed links where they offer one
        self.frames: FramesServer | None = None
        # Group 0's endpoint comes with the transport; data groups add theirs.
        self.groups: dict[int, GroupEndpoint] = {
            0: GroupEndpoint(
                on_message, on_unreachable, on_snapshot_status, snapshot_file, snapshot_dir
            )
        }
        # (peer, the address its link goes to) -> the link
        self.peers: dict[tuple[int, str], _Peer] = {}
        self._flush_due = False  # a ``flush`` is scheduled for the next turn
        self.addresses: dict[int, str] = {}  # peer -> its main address
        # peer -> {group: gRPC port of the peer's process that runs it}, as
        # the peer said; a peer not here has not said yet.
        self.routes: dict[int, dict[int, int]] = {}
        self._routes_asked: dict[int, float] = {}  # peer -> when last asked
        self._routes_tasks: dict[int, asyncio.Task[None]] = {}
        # (peer, group) -> address_of's answer, until the peer's address or
        # routes change.
        self._routed: dict[tuple[int, int], str | None] = {}
        # Groups this node runs in other processes (what FramesEndpoint tells).
        self.group_ports: dict[int, int] = {}
        self.dropped = 0
        self.rejected = 0
        self._snapshot_timers: dict[tuple[int, int], asyncio.TimerHandle] = {}  # (group, to)
        self._fetching: set[tuple[int, int, int]] = set()  # (group, index, term)
        self._sha_cache: dict[tuple[Path, int, int], bytes] = {}
        self._missing_said: set[tuple[int, int, int]] = set()  # (group, index, term) warned of
        # This node's disk is low: said on every batch sent (the process's
        # groups set it, see ``Store``); and what the peers' batches said.
        self.disk_low = False
        self.peer_disks = PeerDisks()
        # Send heartbeats coalesced to the peers that take them, and say
        # this process takes them (off: as a node of an older version).
        self.coalesce = True
        # The operation kinds this node's release applies, said on every
        # batch (set by ``Store``: node_daemon/state/op_gate.py), and what
        # each peer's latest batch said (0: an older release's).
        self.op_level = 0
        self.peer_op_levels: dict[int, int] = {}
        # The greeting in FramesEndpoint: releases and frame formats (peer_frames).
        self.greetings = Greetings(node_id, cluster)

    @classmethod
    def bare(cls, node_id: int, cluster: str, secret: bytes) -> PeerTransport:
        """A transport that runs no group yet (a worker process's: every
        group it runs adds its endpoint)."""
        t = cls(node_id, cluster, secret, Path("."), _no_message, _no_peer, _no_status, _no_file)
        t.groups.clear()
        return t

    def set_group_ports(self, ports: dict[int, int]) -> None:
        """The groups this node runs in other processes, each with the gRPC
        port of its process (told to peers by ``FramesEndpoint``)."""
        self.group_ports = dict(ports)

    def add_group(self, group: int, endpoint: GroupEndpoint) -> None:
        """Route ``group``'s messages to ``endpoint`` (before the group sends)."""
        if group in self.groups:
            raise ValueError(f"Raft group {group} already has an endpoint")
        self.groups[group] = endpoint

    def sender(self, group: int) -> Callable[[list[Message]], None]:
        """``send`` for one group (the group's Ready driver's ``send``)."""
        return lambda msgs: self.send(msgs, group)

    def set_addresses(self, addresses: dict[int, str]) -> None:
        for nid, addr in addresses.items():
            if nid == self.node_id:
                continue
            if self.addresses.get(nid, addr) != addr:
                self._forget_peer(nid)
            self.addresses[nid] = addr
            self._forget_routed(nid)

    def _forget_peer(self, nid: int) -> None:
        """Close every link to ``nid`` and forget its group ports."""
        for key in [k for k in self.peers if k[0] == nid]:
            self.peers.pop(key).task.cancel()
        self.routes.pop(nid, None)
        self._forget_routed(nid)
        self._routes_asked.pop(nid, None)

    def _forget_routed(self, nid: int) -> None:
        for key in [k for k in self._routed if k[0] == nid]:
            del self._routed[key]

    def address_of(self, to: int, group: int) -> str | None:
        """Where ``group``'s messages to ``to`` go (None: not known): the
        port of the peer's process that runs the group, as the peer said,
        else its main address; None too while the peer said the group's
        process is not listening yet (port 0)."""
        key = (to, group)
        if key in self._routed:  # every message asks: worked out once
            return self._routed[key]
        base = self.addresses.get(to)
        if base is None:
            return None
        port = self.routes.get(to, {}).get(group)
        addr = base if port is None else with_port(base, port) if port else None
        self._routed[key] = addr
        return addr

    def send(self, msgs: list[Message], group: int = 0) -> None:
        """Queue ``msgs`` on their peers' links; they leave with the next
        ``flush`` (the event loop's next turn at the latest)."""
        for m in msgs:
            addr = self.address_of(m.to, group)
            if addr is None:
                self.dropped += 1
                if m.to in self.addresses:
                    self._ask_routes(m.to)  # its process for the group may listen now
                continue
            peer = self.peers.get((m.to, addr))
            if peer is None:
                peer = self.peers[(m.to, addr)] = _Peer(self, m.to, addr)
            if not peer.up or m.to not in self.routes:
                # Not said yet, or the process may have moved (a worker
                # that restarted elsewhere leaves its link waiting forever).
                self._ask_routes(m.to)
            if m.type == MessageType.SNAPSHOT:
                self._arm_snapshot_timer(group, m.to)
            peer.put(group, m)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send every peer's queued messages now. ``send`` has this done in
        the event loop's next turn, so that what every group on the loop
        sends meanwhile shares one frame per peer; a caller about to hold
        the loop with disk work (an inline log write or apply) calls it
        first, so that its messages do not wait for that work: on a
        follower, the previous round's apply ran ahead of its append
        response, and so of the commit (bench/profiles/write-path.md,
        session 25)."""
        self._flush_due = False
        for peer in self.peers.values():
            if peer.pending:
                peer.flush()

    def _ask_routes(self, to: int) -> None:
        """Ask ``to`` for its group ports, unless asked within
        ROUTES_RETRY_S or an ask is under way."""
        now = time.monotonic()
        running = self._routes_tasks.get(to)
        if (running is not None and not running.done()) or now - self._routes_asked.get(
            to, -ROUTES_RETRY_S
        ) < ROUTES_RETRY_S:
            return
        self._routes_asked[to] = now
        self._routes_tasks[to] = asyncio.get_running_loop().create_task(self._learn_routes(to))

    async def _learn_routes(self, to: int) -> None:
        addr = self.addresses.get(to)
        if addr is None:
            return
        try:
            async with tls.current().channel(addr) as ch:
                reply = await raft_pb2_grpc.RaftPeerStub(ch).FramesEndpoint(
                    self.greetings.request(),
                    metadata=token_metadata(self.token),
                    timeout=2.0,
                )
            routes = dict(reply.group_ports)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                return  # down or busy: asked again at the next send or break
            routes = {}  # a peer of an older version runs every group itself
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("asking a peer for its group ports failed", extra={"peer": to})
            return
        if self.addresses.get(to) != addr:
            return  # it moved meanwhile: a new ask follows
        if self.routes.get(to) == routes:
            return
        log.info("peer's group ports", extra={"peer": to, "group_ports": routes})
        self.routes[to] = routes
        self._forget_routed(to)
        # Links to processes of the peer that run none of our groups go.
        used = {self.address_of(to, group) for group in self.groups}
        for key in [k for k in self.peers if k[0] == to and k[1] not in used]:
            self.peers.pop(key).task.cancel()

    def _unreachable(self, to: int, address: str) -> None:
        """The link to ``to``'s process at ``address`` broke: every group
        whose messages to ``to`` go there hears of it."""
        for group, g in self.groups.items():
            if self.address_of(to, group) == address:
                g.on_unreachable(to)

    def _snapshot_lost(self, group: int, to: int) -> None:
        self._snapshot_timers.pop((group, to), None)
        log.info("snapshot not pulled; Raft will send it again", extra={"peer": to, "group": group})
        self.groups[group].on_snapshot_status(to, False)

    def _arm_snapshot_timer(self, group: int, to: int) -> None:
        old = self._snapshot_timers.pop((group, to), None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._snapshot_timers[(group, to)] = loop.call_later(
            SNAPSHOT_START_TIMEOUT_S, self._snapshot_lost, group, to
        )

    async def start_frames(self, host: str, port: int) -> int:
        """Offer the framed peer link on (host, port) (0: any free port);
        returns the port, or 0 when it could not bind: peers then use the
        gRPC stream, and the node runs as before."""
        server = FramesServer(self.cluster, self.secret, self._receive, self._reject)
        bound = await server.offer(host, port, "peers stream over gRPC")
        if bound:
            self.frames = server
        return bound

    async def close(self) -> None:
        for task in self._routes_tasks.values():
            task.cancel()
        for task in self._routes_tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.frames is not None:
            await self.frames.close()
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
        sender = _certified_node(context)
        async for batch in request_iterator:  # the cluster token is checked by ClusterAuth
            if batch.cluster != self.cluster:
                self.rejected += 1
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "foreign cluster")
            if sender and not _all_from(batch, sender):
                self.rejected += 1
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"a message not from node {sender}, whose certificate this is",
                )
            self._receive(batch)
        return raft_pb2.StreamClosed()

    def _reject(self) -> None:
        self.rejected += 1

    def _receive(self, batch: raft_pb2.RaftBatch) -> None:
        """Hand a batch's messages to their groups' Raft (a SNAPSHOT once its
        file is here), then its coalesced heartbeats, each as the message it
        stands for (so a group's beats of a batch reach it after its other
        messages of the batch: Raft takes messages in any order). A message
        of a group this node does not run is dropped and counted (Raft
        resends; the group may be starting)."""
        round_trace.mark("peer_in")
        sender = getattr(batch, "from")
        self.peer_disks.heard(sender, batch.disk_low, time.monotonic())
        self.peer_op_levels[sender] = batch.op_level
        groups = self.groups
        for pb in batch.messages:
            g = groups.get(pb.group)
            if g is None:
                self.rejected += 1
                continue
            try:
                if pb.has_snapshot:
                    self._start_fetch(pb)
                else:
                    g.on_message(message_from_pb(pb))
            except ValueError:
                self.rejected += 1
        if batch.beats:
            frm = getattr(batch, "from")
            for b in batch.beats:  # fanned out to their groups
                g = groups.get(b.group)
                if g is None:
                    self.rejected += 1
                    continue
                g.on_message(message_of_beat(b, self.node_id, frm))

    async def FramesEndpoint(
        self,
        request: raft_pb2.FramesEndpointRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> raft_pb2.FramesEndpointReply:
        if request.cluster != self.cluster:  # the cluster token is checked by ClusterAuth
            self.rejected += 1
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "foreign cluster")
        self.greetings.caller(request)
        return raft_pb2.FramesEndpointReply(
            port=self.frames.port if self.frames else 0,
            group_ports=self.group_ports,
            coalesced_heartbeats=self.frames is not None and self.coalesce,
            **self.greetings.reply_fields(),
        )

    async def FetchSnapshot(
        self, request: raft_pb2.SnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[raft_pb2.SnapshotChunk]:
        if request.cluster != self.cluster:  # the cluster token is checked by ClusterAuth
            self.rejected += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad cluster credentials")
        sender = _certified_node(context)
        if sender and request.node_id != sender:
            self.rejected += 1
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {sender} asked for node {request.node_id}'s snapshot",
            )
        group = self.groups.get(request.group)
        if group is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no Raft group {request.group} here")
            return
        timer = self._snapshot_timers.pop((request.group, request.node_id), None)
        if timer is not None:
            timer.cancel()  # the pull started: its end decides
        path = await group.snapshot_file(request.index, request.term)
        if path is None or not path.exists():
            # The pull ended here: Raft sends a snapshot again (a newer one).
            key = (request.group, request.index, request.term)
            if key not in self._missing_said:
                self._missing_said.add(key)
                log.warning(
                    "asked for a snapshot that is not here",
                    extra={"peer": request.node_id, "group": request.group, "index": request.index},
                )
            group.on_snapshot_status(request.node_id, False)
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such snapshot here any more")
            return
        loop = asyncio.get_running_loop()
        st = path.stat()
        made = (path, st.st_ino, st.st_mtime_ns)  # a file made again under its name is another
        sha = self._sha_cache.get(made)
        if sha is None:
            sha = self._sha_cache[made] = await loop.run_in_executor(None, file_sha256, path)
        size = st.st_size
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
            group.on_snapshot_status(request.node_id, ok)

    # ----------------------------------------------------- receiving a snapshot

    def _start_fetch(self, pb: raft_pb2.RaftMessage) -> None:
        key = (pb.group, pb.snapshot.index, pb.snapshot.term)
        if key in self._fetching:
            return
        self._fetching.add(key)
        asyncio.get_running_loop().create_task(self._fetch(pb, key))

    async def _fetch(self, pb: raft_pb2.RaftMessage, key: tuple[int, int, int]) -> None:
        sender = getattr(pb, "from")
        group, index, term = key
        where = {"from": sender, "index": index, "group": group}
        t0 = time.monotonic()
        log.info("pulling snapshot", extra=where)
        try:
            path = await self.fetch_snapshot(sender, index, term, group=group)
            if path is not None:
                log.info(
                    "snapshot received",
                    extra={
                        **where,
                        "bytes": path.stat().st_size,
                        "seconds": round(time.monotonic() - t0, 3),
                    },
                )
                self.groups[group].on_message(message_from_pb(pb, str(path).encode()))
        except Exception:
            log.exception("snapshot fetch failed", extra=where)
        finally:
            self._fetching.discard(key)

    async def fetch_snapshot(
        self, sender: int, index: int, term: int, attempts: int = 5, group: int = 0
    ) -> Path | None:
        """Download one of ``group``'s snapshots, verified; resumes after a
        broken stream or a bad chunk. Returns the local path, or None if it
        could not be had."""
        addr = self.address_of(sender, group)
        if addr is None:
            return None
        snapshot_dir = self.groups[group].snapshot_dir
        snapshot_dir.mkdir(parents=True, exist_ok=True)
        dest = received_path(snapshot_dir, index, term)
        part = dest.with_suffix(".part")
        offset = part.stat().st_size if part.exists() else 0
        for attempt in range(attempts):
            sha, total = b"", -1
            try:
                opts = [("grpc.max_receive_message_length", 8 << 20)]
                async with tls.current().channel(addr, options=opts) as ch:
                    stub = raft_pb2_grpc.RaftPeerStub(ch)
                    req = raft_pb2.SnapshotRequest(
                        cluster=self.cluster,
                        index=index,
                        term=term,
                        offset=offset,
                        node_id=self.node_id,
                        group=group,
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
                    # The log will name this file once the core takes it: its
                    # name must survive a power loss first.
                    await loop.run_in_executor(None, fsync_dir, snapshot_dir)
                    return dest
                part.unlink(missing_ok=True)  # complete but wrong: start over
                offset = 0
        part.unlink(missing_ok=True)
        return None
