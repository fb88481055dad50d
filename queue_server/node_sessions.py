"""The nodes' side of the queue server: each node's Work session (a gRPC
``Pull`` stream or a framed Work link in mutual TLS), what it tells (its
state, its credit, its results) and what goes out to it (work items in
batches, the fence it should hurry to). The queues are ``QueueServer``'s
(``queue_server.server``), of which ``NodeSessions`` is a part."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from queue_server.config import QueueConfig
from queue_server.metrics import FRAMES_REJECTED, WORKERS
from queue_server.outgoing import _ITEMS_FENCE_WAIT, Outgoing
from queue_server.queues import WorkQueues
from roadlog import round_trace
from roadlog.errors import Code
from roadlog.limits import WORK_BATCH_BYTES
from roadlog.protowire import length_delimited
from roadlog.runtime import tls
from roadlog.runtime.frames import WORK, FramedServer, OnFrame, ServerConn
from roadlog.v1 import client_pb2, raft_pb2, work_pb2, work_pb2_grpc

log = logging.getLogger("roadlog.queue")

MAX_ATTEMPTS = 50  # a write sent back (UNAVAILABLE) this often is given up


class NodeSessions(work_pb2_grpc.WorkServicer):
    """The part of ``QueueServer`` that faces the nodes (see the module doc)."""

    cfg: QueueConfig
    q: WorkQueues
    _ids: itertools.count[int]
    _futures: dict[int, asyncio.Future[work_pb2.WorkResult]]
    _sessions: dict[int, asyncio.Queue[Outgoing | work_pb2.FenceWait | None]]
    _fence_told: dict[int, tuple[int, bool]]
    states: dict[int, work_pb2.WorkerState]
    statuses: dict[int, client_pb2.NodeStatus]
    _session_node: dict[int, int]
    _pumps: set[asyncio.Task[None]]
    frames: FramedServer | None  # the framed Work link, when offered
    frames_rejected: int

    if TYPE_CHECKING:  # the queues' side, in QueueServer

        def _kick(self) -> None: ...

        def _expire(self, now: float) -> None: ...

    async def Pull(
        self, request_iterator: AsyncIterator[work_pb2.WorkerMessage], context: Any
    ) -> AsyncIterator[work_pb2.WorkItems]:
        # The cluster token is checked by ClusterAuth; with TLS only a node's
        # certificate gets here (CertAuth), and the stream is bound to it.
        ident = tls.grpc_identity(context)
        wid = self._open_session(ident.node_id if ident is not None else 0)

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    self._worker_message(wid, msg)
            finally:
                self._end_session(wid)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            async for parts in self._batches(wid):
                yield work_pb2.WorkItems.FromString(b"".join(parts))
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self._close_session(wid)

    async def FramesEndpoint(
        self, request: raft_pb2.FramesEndpointRequest, context: Any
    ) -> raft_pb2.FramesEndpointReply:
        if request.cluster != self.cfg.cluster_name:  # the token is checked by ClusterAuth
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "foreign cluster")
        return raft_pb2.FramesEndpointReply(port=self.frames.port if self.frames else 0)

    def open_frames(self, conn: ServerConn) -> OnFrame:
        """A framed Work link authenticated as node ``conn.peer_id``: the same
        session as ``Pull``; its frames are WorkerMessages one way and
        WorkItems the other. A message that does not parse, or a state of
        another node, cuts the link."""
        wid = self._open_session(conn.peer_id)
        conn.lost.add_done_callback(lambda _: self._end_session(wid))

        async def pump() -> None:
            try:
                async for parts in self._batches(wid):
                    round_trace.mark("q_work_out")
                    await conn.send_parts(parts)
            except ConnectionError:
                pass
            finally:
                conn.abort()
                self._close_session(wid)

        task = asyncio.get_running_loop().create_task(pump())
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)

        def receive(data: bytes) -> None:
            round_trace.mark("q_result_in")
            self._worker_message(wid, work_pb2.WorkerMessage.FromString(data))

        return receive

    def _open_session(self, node_id: int = 0) -> int:
        """A node's Work session (a Pull stream or a framed link); ``node_id``
        is the node that authenticated (0: any may speak for itself)."""
        wid = next(self._ids)
        self._sessions[wid] = asyncio.Queue()
        self._fence_told[wid] = (0, False)
        self._session_node[wid] = node_id
        self._sessions[wid].put_nowait(work_pb2.FenceWait())  # first word: this server tells fences
        return wid

    def _end_session(self, wid: int) -> None:
        """No more messages from the node: its batches end."""
        out = self._sessions.get(wid)
        if out is not None:
            out.put_nowait(None)

    def _worker_message(self, wid: int, msg: work_pb2.WorkerMessage) -> None:
        if wid not in self._sessions:
            return  # closed
        connected = wid in self.q.workers
        if msg.HasField("state"):
            s = msg.state
            if not connected:
                bound = self._session_node.get(wid, 0)
                if bound and s.node_id != bound:
                    raise ValueError(f"node {bound} spoke for node {s.node_id}")
                self.q.connect(wid, s.node_id, runs_group_0=not s.data_groups_only)
                connected = True
                WORKERS.set(len(self.q.workers))
                log.info("node connected", extra={"node": s.node_id, "worker": wid})
            elif (s.node_id, s.data_groups_only) != (
                self.states[wid].node_id,
                self.states[wid].data_groups_only,
            ):
                raise ValueError("a Work session changed its node id or what it runs")
            self.states[wid] = s
            if s.HasField("status"):
                self.statuses[wid] = s.status
            self.q.update(
                wid,
                s.is_leader,
                s.term,
                s.applied_index,
                [(g.group, g.is_leader, g.term, g.applied_index) for g in s.groups],
            )
        if not connected:
            return
        if msg.HasField("credit"):
            self.q.grant(wid, msg.credit.writes, msg.credit.reads)
        for r in msg.results:
            self._result(wid, r)
        self._kick()

    async def _batches(self, wid: int) -> AsyncIterator[list[bytes]]:
        """What goes out to the node, until its session ends, as the wire
        bytes of one WorkItems each (in parts: the requests as they are):
        what is ready, up to WORK_BATCH_BYTES (an item bigger than that
        goes alone), so the node's link takes WORK_MESSAGE_BYTES, never a
        merge of big requests. The newest FenceWait rides along."""
        out = self._sessions[wid]
        carried: Outgoing | None = None  # did not fit the last message
        while True:
            nxt = carried if carried is not None else await out.get()
            carried = None
            if nxt is None:
                return
            parts: list[bytes] = []
            fence: bytes | None = None
            size = 0
            while True:
                if isinstance(nxt, work_pb2.FenceWait):
                    fence = nxt.SerializeToString()  # an empty one says "none"
                elif parts and size + len(nxt.request) > WORK_BATCH_BYTES:
                    carried = nxt
                    break
                else:
                    parts += nxt.parts()
                    size += len(nxt.request)
                if out.empty():
                    break
                nxt = out.get_nowait()
                if nxt is None:
                    break
            if fence is not None:  # once: a repeated singular field would merge
                parts += [length_delimited(_ITEMS_FENCE_WAIT, len(fence)), fence]
            yield parts
            if nxt is None:
                return

    def _close_session(self, wid: int) -> None:
        """The node is gone: what it held goes back to the queues (idempotent)."""
        if self._sessions.pop(wid, None) is None:
            return
        self._fence_told.pop(wid, None)
        self._session_node.pop(wid, None)
        self.states.pop(wid, None)
        self.statuses.pop(wid, None)
        back = self.q.disconnect(wid, time.monotonic())
        WORKERS.set(len(self.q.workers))
        log.info("node disconnected", extra={"worker": wid, "requeued": len(back)})
        self._expire(time.monotonic())
        self._kick()

    def _result(self, wid: int, r: work_pb2.WorkResult) -> None:
        fut = self._futures.get(r.id)
        if r.code == Code.UNAVAILABLE:
            it = self.q.retry(wid, r.id)
            if it is not None and it.attempts < MAX_ATTEMPTS and fut is not None and not fut.done():
                return  # another node (the new leader) will take it
            if it is not None:
                # Given up (or no one waits for it): out of the queue, so no
                # node does it after its client heard UNAVAILABLE.
                self.q.cancel(r.id)
        else:
            self.q.complete(wid, r.id)
        if fut is not None and not fut.done():
            fut.set_result(r)

    async def start_frames(self, host: str, port: int) -> int:
        """Offer the framed Work link on (host, port) (0: any free port);
        returns the port, or 0 when it could not bind: nodes then pull over
        gRPC, and the queue server runs as before. With TLS it is the only
        way nodes pull (mutual TLS): a port that cannot be bound is an error."""
        server = FramedServer(
            WORK, self.cfg.cluster_name, self.cfg.secret(), self.open_frames, self._reject
        )
        if server.ssl is not None:  # with TLS, the only way nodes can pull: it must be there
            try:
                bound = await server.start(host, port)
            except OSError as e:
                raise RuntimeError(f"work_frames_port {port}: cannot bind it ({e})") from None
        else:
            bound = await server.offer(host, port, "nodes pull over gRPC")
        if bound:
            self.frames = server
        return bound

    def _reject(self) -> None:
        self.frames_rejected += 1
        FRAMES_REJECTED.inc()
