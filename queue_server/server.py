"""The queue server process: the client API (gRPC) in front, the Work
service behind (nodes pull), and the sans-I/O ``WorkQueues`` in between.

Client requests are kept as bytes end to end: the queue server reads only
what routing needs (a fetch's fence), and the node that takes the work
parses the rest. A result that says "not here" (UNAVAILABLE: the node lost
leadership, say) sends the item back to the queue for another node, until
the client's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter, Gauge, Histogram

from discovery.agent import DiscoveryAgent
from discovery.core import DiscoveryCore
from queue_server.auth import (
    V4_PREFIX,
    V6_PREFIX,
    Authenticator,
    Caller,
    Gate,
    Principal,
    RateLimit,
    RateLimited,
    TrustedProxies,
    peer_host,
    rate_key,
)
from queue_server.config import QueueConfig
from queue_server.dashboard import DashboardSettings
from queue_server.http_api import BodyLimits, HttpApi
from queue_server.parts import merge as merge_parts
from queue_server.publish_link import PublishLinkServer
from queue_server.publish_stream import SERVICE as PUBLISH_STREAM
from queue_server.publish_stream import publish_stream_handler
from queue_server.queues import Item, QueueFull, WorkQueues
from roadlog import round_trace
from roadlog.errors import Code, RoadlogError
from roadlog.grpc_status import to_grpc
from roadlog.limits import CLIENT_MESSAGE_BYTES, WORK_BATCH_BYTES, WORK_MESSAGE_BYTES, grpc_options
from roadlog.protowire import leading_varint, length_delimited
from roadlog.rpc import BY_NAME, ROUTED, SERVICE, Kind
from roadlog.runtime import frames, tls
from roadlog.runtime.auth import ClusterAuth, cluster_token, protects
from roadlog.runtime.health import serve_metrics_and_health
from roadlog.scopes import new_token, token_hash
from roadlog.v1 import client_pb2, clients_pb2, raft_pb2, work_pb2, work_pb2_grpc

log = logging.getLogger("roadlog.queue")

MAX_ATTEMPTS = 50
# A read fenced beyond every node's commit index waits this long (the
# nodes' state may lag the write's answer a little) before it is refused.
FENCE_GRACE_S = 2.0

DEPTH = Gauge("roadlog_queue_depth", "requests waiting", ["kind"])
DEPTH_BYTES = Gauge("roadlog_queue_bytes", "bytes of requests waiting", ["kind"])
WAIT = Histogram(
    "roadlog_queue_wait_seconds",
    "time from arrival to being handed to a node",
    ["kind"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)
TAKEN = Counter("roadlog_queue_work_taken_total", "work handed to each node", ["node", "kind"])
REQUESTS = Counter(
    "roadlog_queue_requests_total", "client requests by method and outcome", ["method", "code"]
)
WORKERS = Gauge("roadlog_queue_connected_nodes", "nodes pulling work from this queue server")
SPLIT = Counter(
    "roadlog_queue_split_publishes_total",
    "calls with publishes group 0's leader split over data groups (their senders did not "
    "route them by group), and the parts handed out",
    ["what"],
)
_SPLIT_CALLS, _SPLIT_PARTS = SPLIT.labels("calls"), SPLIT.labels("parts")
FRAMES_REJECTED = Counter(
    "roadlog_queue_frames_rejected_total",
    "framed Work links refused (bad hello) or cut (bad input)",
)
PUBLISH_LINKS_REJECTED = Counter(
    "roadlog_queue_publish_links_rejected_total",
    "clients' publish links cut for bad input (a bad hello or envelope, a frame too big)",
)
ANSWERED = Histogram(
    "roadlog_queue_answer_seconds",
    "time from a client request's arrival (gRPC or HTTP) to its answer, by method and outcome "
    "(ok, error); for publishes: the ack latency",
    ["method", "outcome"],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 30),
)


def count_publish_batch(code: str) -> None:
    """A PublishBatch over a stream or a publish link was answered with ``code``."""
    REQUESTS.labels("PublishBatch", code).inc()


_ITEMS_ITEMS = 1  # WorkItems.items
_ITEMS_FENCE_WAIT = 2  # WorkItems.fence_wait
_ITEM_REQUEST = 4  # WorkItem.request
_KIND = {Kind.WRITE: work_pb2.WORK_KIND_WRITE, Kind.READ: work_pb2.WORK_KIND_READ}
# Where a publish's routing hint is (PublishRequest.group, PublishBatchRequest.group).
_GROUP_HINT_FIELD = {"Publish": 7, "PublishBatch": 2}


@dataclass(slots=True, eq=False)
class Outgoing:
    """A work item on its way to a node: its WorkItem's wire bytes but the
    request (``head``: every other field, then the request's tag and
    length) and the request as the client sent it, never copied."""

    id: int
    head: bytes
    request: bytes

    @classmethod
    def of(cls, it: Item, now: float) -> Outgoing:
        """``it`` handed out at ``now`` (monotonic): its deadline goes as
        the wall-clock time and as the milliseconds left (``budget_ms``)."""
        left = max(it.deadline - now, 0.001)
        head = work_pb2.WorkItem(
            id=it.id,
            kind=_KIND[it.kind],
            method=it.method,
            fence=it.fence,
            deadline_unix_ms=int((time.time() + left) * 1000),
            principal=it.principal,
            group=it.group,
            budget_ms=min(int(left * 1000) or 1, (1 << 32) - 1),
        ).SerializeToString()
        return cls(it.id, head + length_delimited(_ITEM_REQUEST, len(it.request)), it.request)

    def parts(self) -> list[bytes]:
        """This item as an element of WorkItems.items."""
        size = len(self.head) + len(self.request)
        return [length_delimited(_ITEMS_ITEMS, size), self.head, self.request]


# Metric children bound once (labels() per item or per kick costs more than
# the count itself).
_KIND_LABEL = {Kind.WRITE: "write", Kind.READ: "read"}
_DEPTH = {k: DEPTH.labels(label) for k, label in _KIND_LABEL.items()}
_DEPTH_BYTES = {k: DEPTH_BYTES.labels(label) for k, label in _KIND_LABEL.items()}
_WAIT = {k: WAIT.labels(label) for k, label in _KIND_LABEL.items()}


@functools.cache
def _taken(node_id: int, kind: Kind) -> Any:
    return TAKEN.labels(str(node_id), _KIND_LABEL[kind])


class QueueServer(work_pb2_grpc.WorkServicer):
    def __init__(self, cfg: QueueConfig) -> None:
        self.cfg = cfg
        self.q = WorkQueues(cfg.max_writes, cfg.max_reads, max_bytes=cfg.max_queued_bytes)
        self.token = cluster_token(cfg.secret(), cfg.cluster_name)
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future[work_pb2.WorkResult]] = {}
        # per worker: what goes out on its stream (None: the end)
        self._sessions: dict[int, asyncio.Queue[Outgoing | work_pb2.FenceWait | None]] = {}
        # per worker: the FenceWait (index, reads) it was told last
        self._fence_told: dict[int, tuple[int, bool]] = {}
        self.states: dict[int, work_pb2.WorkerState] = {}
        self.statuses: dict[int, client_pb2.NodeStatus] = {}  # the last full status per worker
        self._session_node: dict[int, int] = {}  # per worker: the node its link authenticated
        self._pumps: set[asyncio.Task[None]] = set()  # the framed links' senders
        self.frames: frames.FramedServer | None = None  # the framed Work link, when offered
        self.publish_link: PublishLinkServer | None = None  # clients' framed link, when offered
        self.frames_rejected = 0  # framed links refused or cut for bad input
        self.gate = Gate(Authenticator(self._authenticate), enabled=cfg.client_auth != "none")
        self.registrations = RateLimit(cfg.registrations_per_minute)
        self.proxies = TrustedProxies(cfg.trusted_proxies)

    # ------------------------------------------------------------- clients

    async def client_call(
        self, method: str, request: bytes, timeout: float | None, caller: Caller
    ) -> bytes:
        """A client's call (gRPC or HTTP): admitted by the gate (who calls,
        may they), then queued for a node with the caller's identity."""
        t0 = time.monotonic()
        outcome = "error"
        try:
            principal = await self.gate.admit(method, request, caller)
            if method in ("CreateClient", "RegisterClient"):
                answer = await self._new_client(method, request, timeout, caller)
            else:
                # Fair between identities; without one, between declared ids or addresses.
                lane = principal.client_id or caller.declared or caller.source
                answer = await self._call(method, request, timeout, lane, principal)
                if method == "RevokeClient":
                    name = clients_pb2.RevokeClientRequest.FromString(request).name
                    self.gate.auth.forget(name)  # here at once; elsewhere within the cache's TTL
            outcome = "ok"
            return answer
        finally:
            ANSWERED.labels(method, outcome).observe(time.monotonic() - t0)

    async def authenticate(self, caller: Caller) -> Principal | None:
        """The caller's identity (UNAUTHENTICATED without a good token);
        None when client_auth is none."""
        if not self.gate.enabled:
            return None
        return await self.gate.auth.principal(caller.credential, caller.source)

    async def _new_client(
        self, method: str, request: bytes, timeout: float | None, caller: Caller
    ) -> bytes:
        """A new identity: its token made here, only its hash sent on; the
        answer carries the token, which nothing keeps."""
        if method == "RegisterClient":
            if not self.cfg.open_registration:
                raise RoadlogError(
                    Code.PERMISSION_DENIED,
                    "self-registration is off on this queue server (open_registration = false): "
                    "ask an operator for a token",
                )
            block = rate_key(caller.source)  # one bucket per /24 or /64, HTTP and gRPC alike
            if not self.registrations.take(block):
                raise RateLimited(
                    f"too many registrations from {block}: at most "
                    f"{self.cfg.registrations_per_minute} a minute per /{V4_PREFIX} "
                    f"(IPv4) or /{V6_PREFIX} (IPv6)",
                    self.registrations.retry_after(block),
                )
        token = new_token()
        if method == "RegisterClient":
            request = clients_pb2.RegisterClientRequest(
                token_hash=token_hash(token)
            ).SerializeToString()
        else:
            try:
                req = clients_pb2.CreateClientRequest.FromString(request)
            except Exception:
                raise RoadlogError(Code.INVALID_ARGUMENT, "malformed CreateClientRequest") from None
            req.token_hash = token_hash(token)  # a client's own is replaced
            request = req.SerializeToString()
        raw = await self._call(method, request, timeout, caller.source, None)
        resp = clients_pb2.CreateClientResponse.FromString(raw)
        resp.token = token
        return resp.SerializeToString()

    async def _authenticate(self, h: bytes, source: str) -> clients_pb2.AuthenticateResponse:
        """Whose token has hash ``h``: a read any node answers, fenced at the
        highest commit index a node told, then, if it found none, the
        leader's (so an identity just made is found); queued in the
        asker's lane."""
        fence = max((s.commit_index for s in self.states.values()), default=0)
        req = clients_pb2.AuthenticateRequest(token_hash=h, min_applied_index=fence)
        raw = await self.call("Authenticate", req.SerializeToString(), 5.0, f"auth:{source}")
        resp = clients_pb2.AuthenticateResponse.FromString(raw)
        if not resp.found:
            # The indexes nodes told may lag a creation just answered: the
            # leader has applied it (a bad token costs one more read, then
            # its refusal is cached).
            at_leader = clients_pb2.AuthenticateRequest(token_hash=h)  # writes take no fence
            raw = await self.call(
                "AuthenticateAtLeader", at_leader.SerializeToString(), 5.0, f"auth:{source}"
            )
            resp = clients_pb2.AuthenticateResponse.FromString(raw)
        return resp

    async def call(
        self, method: str, request: bytes, timeout: float | None, client: str = ""
    ) -> bytes:
        """Queue one request of the queue server's own (no identity) and
        wait for its answer. ``client`` is who asks (the unit of fairness)."""
        t0 = time.monotonic()
        outcome = "error"
        try:
            answer = await self._call(method, request, timeout, client, None, own=True)
            outcome = "ok"
            return answer
        finally:
            ANSWERED.labels(method, outcome).observe(time.monotonic() - t0)

    async def _call(
        self,
        method: str,
        request: bytes,
        timeout: float | None,
        client: str,
        principal: Principal | None,
        own: bool = False,
    ) -> bytes:
        """Queue one request and wait for its answer; ``own``: the queue
        server's own (see ``Item.own``)."""
        rpc = ROUTED[method]
        kind = rpc.kind
        assert kind is not None  # QUEUED holds the rpcs that have a queue
        if len(request) > CLIENT_MESSAGE_BYTES:
            raise RoadlogError(
                Code.RESOURCE_EXHAUSTED,
                f"request of {len(request)} bytes is over the limit of {CLIENT_MESSAGE_BYTES}",
            )
        fence = 0
        if rpc.fenced and kind == Kind.READ:  # read your writes: the fence routes it
            cls = rpc.request
            try:
                fence = cls.FromString(request).min_applied_index  # type: ignore[attr-defined]
            except Exception:
                raise RoadlogError(
                    Code.INVALID_ARGUMENT, f"malformed {cls.DESCRIPTOR.name}"
                ) from None
        now = time.monotonic()
        wait = timeout if timeout is not None else self.cfg.default_timeout_ms / 1000
        # Answer a little before the client's deadline, so it hears the reason.
        wait = max(wait - min(0.2, wait / 4), 0.01)
        item = Item(
            next(self._ids),
            kind,
            method,
            request,
            now + wait,
            now,
            fence,
            client=client,
            principal=principal.client_id if principal is not None else "",
            group=self._group_hint(method, request),
            own=own,
        )
        try:
            self.q.submit(item)
        except QueueFull as e:
            raise RoadlogError(Code.RESOURCE_EXHAUSTED, str(e)) from None
        res = await self._answer(item)
        if res.code:
            raise RoadlogError(Code.of(res.code), res.message)
        if res.parts:
            return await self._parts(item, res)
        return res.response

    def _group_hint(self, method: str, request: bytes) -> int:
        """The data group a publish says all its pings lie in (the SDK
        writes it first: read without parsing), when some node runs that
        group; else 0 (group 0's leader takes it, and splits it if its
        topic is placed in data groups). The group's leader checks it."""
        field = _GROUP_HINT_FIELD.get(method)
        if field is None:
            return 0
        g = leading_varint(request, field)
        return g if g and self.q.runs_group(g) else 0

    async def _answer(self, item: Item) -> work_pb2.WorkResult:
        """Wait for a submitted item's result, up to its deadline (then
        DEADLINE_EXCEEDED); an item nobody waits for any more leaves the queue."""
        fut: asyncio.Future[work_pb2.WorkResult] = asyncio.get_running_loop().create_future()
        self._futures[item.id] = fut
        self._kick()
        try:
            return await asyncio.wait_for(fut, item.deadline - time.monotonic() + 0.5)
        except TimeoutError:
            raise RoadlogError(Code.DEADLINE_EXCEEDED, "no answer before the deadline") from None
        finally:
            self._futures.pop(item.id, None)
            if not fut.done() or fut.cancelled():  # timed out, or the client went away
                self.q.cancel(item.id)

    async def _parts(self, parent: Item, res: work_pb2.WorkResult) -> bytes:
        """A publish group 0's leader split across data groups: each part a
        write of its group (``AppendPart``, the parent's deadline, lane and
        identity), the client answered once every part is (``parts.merge``)."""
        _SPLIT_CALLS.inc()
        _SPLIT_PARTS.inc(len(res.parts))
        now = time.monotonic()
        children = [
            Item(
                next(self._ids),
                Kind.WRITE,
                "AppendPart",
                p.op,
                parent.deadline,
                now,
                client=parent.client,
                principal=parent.principal,
                group=p.group,
            )
            for p in res.parts
        ]

        async def one(child: Item) -> work_pb2.WorkResult:
            try:
                self.q.submit(child)
                return await self._answer(child)
            except QueueFull as e:
                return work_pb2.WorkResult(code=Code.RESOURCE_EXHAUSTED, message=str(e))
            except RoadlogError as e:
                return work_pb2.WorkResult(code=e.code, message=e.message)

        results = await asyncio.gather(*(one(c) for c in children))
        return merge_parts(parent.method == "Publish", res.response, res.parts, results)

    def _kick(self) -> None:
        now = time.monotonic()
        for wid, it in self.q.dispatch(now):
            session = self._sessions.get(wid)
            w = self.q.workers.get(wid)
            if session is None or w is None:
                continue
            _WAIT[it.kind].observe(now - it.enqueued)
            _taken(w.node_id, it.kind).inc()
            session.put_nowait(Outgoing.of(it, now))
        for queue_kind in (Kind.WRITE, Kind.READ):
            _DEPTH[queue_kind].set(self.q.depth(queue_kind))
            _DEPTH_BYTES[queue_kind].set(self.q.queues[queue_kind].bytes)
        self._tell_fences()

    def _tell_fences(self) -> None:
        """Nodes tell their applied index promptly only while fenced reads
        need it (``FenceWait``), else now and then. Ask the nodes below the
        highest fence reads wait for, and all of them while fenced reads
        keep coming; tell them when that ends. A node that told an index at
        or above what it was asked stops by itself, so a read served needs
        no second message."""
        wanted = self.q.awaited_fence()
        flowing = self.q.reads_flowing(time.monotonic())
        if not wanted and not flowing and not any(i or r for i, r in self._fence_told.values()):
            return
        for wid, w in self.q.workers.items():
            applied = w.applied_in(0)  # -1: a worker process's link, no group 0
            want = (wanted if applied >= 0 and wanted > applied else 0, flowing)
            index, reads = self._fence_told.get(wid, (0, False))
            if want != (index if index > applied else 0, reads):
                session = self._sessions.get(wid)
                if session is not None:
                    self._fence_told[wid] = want
                    session.put_nowait(work_pb2.FenceWait(index=want[0], reads=flowing))

    async def expire_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        """Answer the requests dropped from the queues: past their deadline,
        fenced beyond every commit, or given up after breaking streams."""
        if self.states:
            commit = max(s.commit_index for s in self.states.values())
            group_commits: dict[int, int] = {}
            for st in self.states.values():
                for g in st.groups:
                    group_commits[g.group] = max(group_commits.get(g.group, 0), g.commit_index)
            for it in self.q.drop_unreachable_fences(commit, now - FENCE_GRACE_S, group_commits):
                seen = group_commits.get(it.group, 0) if it.group else commit
                of = f" of group {it.group}" if it.group else ""
                self._fail(
                    it.id,
                    Code.OUT_OF_RANGE,
                    f"min_applied_index {it.fence} is beyond the cluster's commit index{of} "
                    f"{seen}: no write was answered with it",
                )
        for e in self.q.expire(now):
            if e.gave_up:
                self._fail(e.item.id, Code.INTERNAL, e.reason)
            else:
                self._fail(e.item.id, Code.UNAVAILABLE, e.reason)
        self._tell_fences()  # reads dropped, or none came in lately: nodes need not hurry

    def _fail(self, item_id: int, code: Code, message: str) -> None:
        fut = self._futures.get(item_id)
        if fut is not None and not fut.done():
            fut.set_result(work_pb2.WorkResult(id=item_id, code=code, message=message))

    # --------------------------------------------------------------- nodes

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

    def open_frames(self, conn: frames.ServerConn) -> frames.OnFrame:
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
        server = frames.FramedServer(
            frames.WORK, self.cfg.cluster_name, self.cfg.secret(), self.open_frames, self._reject
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

    async def start_publish_link(self, host: str, port: int) -> int:
        """Offer clients the publish link on (host, port) (0: any free
        port), in TLS with this server's certificate (no client
        certificate). Returns the port, or 0 when it could not bind:
        clients then publish over gRPC, as before."""
        server = PublishLinkServer(
            self.client_call,
            count_publish_batch,
            PUBLISH_LINKS_REJECTED.inc,
            tls.current().server_ssl(mutual=False),
            authenticate=self.authenticate,
        )
        if await server.offer(host, port):
            self.publish_link = server
        return self.publish_link_port()

    def publish_link_port(self) -> int:
        """The publish link's port (0: none)."""
        return self.publish_link.port if self.publish_link is not None else 0

    # -------------------------------------------------------------- status

    def status(self) -> client_pb2.ClusterStatus:
        st = client_pb2.ClusterStatus()
        leaders = [s for s in self.states.values() if s.is_leader]
        if leaders:
            lead = max(leaders, key=lambda s: s.term)
            st.leader, st.term = lead.node_id, lead.term
        elif self.states:
            st.term = max(s.term for s in self.states.values())
        seen = set()
        # A node's main process speaks for it; its worker processes' links
        # (data_groups_only) come after it and are not shown on their own.
        by_node = sorted(
            self.states.items(), key=lambda ws: (ws[1].node_id, ws[1].data_groups_only)
        )
        for wid, s in by_node:
            if s.node_id in seen:
                continue
            seen.add(s.node_id)
            ns = st.nodes.add()
            if wid in self.statuses:  # as the node built it (node_daemon/status.py)
                ns.CopyFrom(self.statuses[wid])
            # the routing fields are newer: they ride on every result
            ns.id, ns.address, ns.term, ns.leader = s.node_id, s.address, s.term, s.leader
            ns.commit_index, ns.applied_index = s.commit_index, s.applied_index
        qs = st.queue_servers.add(grpc=self.cfg.address)
        if self.cfg.http_listen:
            scheme = "http" if tls.current().insecure else "https"
            qs.http = f"{scheme}://{self.cfg.http_listen}"
        return st


CLIENT_METADATA = "roadlog-client"
AUTHORIZATION = "authorization"
FORWARDED_METADATA = "x-forwarded-for"


def caller_of(context: Any, proxies: TrustedProxies | None = None) -> Caller:
    """Who a gRPC request is from: its credential (``authorization``
    metadata), its host (plain, as HTTP names it; from a trusted proxy, the
    address its ``x-forwarded-for`` names), and the client id it declares
    in metadata."""
    credential: str | None = None
    declared = ""
    forwarded: str | None = None
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION:
            credential = str(value)
        elif key == CLIENT_METADATA and value:
            declared = str(value)[:128]
        elif key == FORWARDED_METADATA:
            forwarded = str(value)
    host = peer_host(str(context.peer() or ""))
    if proxies is not None:
        host = proxies.client(host, forwarded)
    return Caller(credential, host, declared)


def client_handler(server: QueueServer) -> grpc.GenericRpcHandler:
    """The Roadlog service with requests and responses kept as bytes."""

    def unary(method: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        async def handle(request: bytes, context: Any) -> bytes:
            remaining = context.time_remaining()
            try:
                caller = caller_of(context, server.proxies)
                out = await server.client_call(method, request, remaining, caller)
            except RoadlogError as e:
                REQUESTS.labels(method, e.code.name).inc()
                await context.abort(to_grpc(e.code), e.message)
            REQUESTS.labels(method, "OK").inc()
            return out

        return handle

    async def status(request: bytes, context: Any) -> bytes:
        try:
            await server.gate.admit("Status", request, caller_of(context, server.proxies))
        except RoadlogError as e:
            REQUESTS.labels("Status", e.code.name).inc()
            await context.abort(to_grpc(e.code), e.message)
        REQUESTS.labels("Status", "OK").inc()
        return server.status().SerializeToString()

    local: dict[str, Callable[[bytes, Any], Awaitable[bytes]]] = {"Status": status}
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        name: grpc.unary_unary_rpc_method_handler(
            unary(name) if rpc.kind is not None else local[name]
        )
        for name, rpc in BY_NAME.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _queue_callers(method: str) -> tuple[str, ...] | None:
    """Certificate kinds that may call ``method`` (None: anyone)."""
    return ("node",) if method == "/roadlog.v1.Work/Pull" else None


async def serve(cfg: QueueConfig, started: asyncio.Event | None = None) -> None:
    qs = QueueServer(cfg)
    # One port serves clients and the nodes' Work streams: it takes what a
    # node may send, and ``call`` refuses a client request over its own limit.
    security = tls.current()
    interceptors: list[grpc.aio.ServerInterceptor] = [
        ClusterAuth(qs.token, protects(["roadlog.v1.Work"]))
    ]
    if not security.insecure:
        # The port is TLS without client certificates (clients have none), so
        # no caller here is a node: Pull is refused; nodes pull over the
        # framed Work link, in mutual TLS.
        interceptors.insert(0, tls.CertAuth(_queue_callers))
    server = grpc.aio.server(interceptors=interceptors, options=grpc_options(WORK_MESSAGE_BYTES))
    server.add_generic_rpc_handlers(
        (
            client_handler(qs),
            publish_stream_handler(
                qs.client_call,
                lambda context: caller_of(context, qs.proxies),
                count_publish_batch,
                qs.publish_link_port,
            ),
        )
    )
    work_pb2_grpc.add_WorkServicer_to_server(qs, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if cfg.grpc_reflection:
        reflection.enable_server_reflection(
            (
                "roadlog.v1.Roadlog",
                PUBLISH_STREAM,
                "roadlog.v1.Work",
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            server,
        )
    if security.add_port(server, cfg.listen, mutual=False) == 0:
        raise RuntimeError(f"cannot bind {cfg.listen}")
    if cfg.work_frames_port >= 0:
        await qs.start_frames(cfg.listen.rpartition(":")[0], cfg.work_frames_port)
    if cfg.publish_link_port >= 0:
        await qs.start_publish_link(cfg.listen.rpartition(":")[0], cfg.publish_link_port)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if cfg.metrics_port:

        def readiness_detail() -> tuple[bool, dict[str, Any]]:
            st = qs.status()
            return bool(st.leader), {"leader": st.leader, "nodes": len(st.nodes)}

        serve_metrics_and_health(
            cfg.metrics_host or cfg.listen.rpartition(":")[0],
            cfg.metrics_port,
            readiness_detail,
            ssl_context=security.server_ssl(mutual=False),  # HTTPS with TLS (Prometheus: the CA)
        )
    http_runner = None
    if cfg.http_listen:
        host, _, port = cfg.http_listen.rpartition(":")
        settings = DashboardSettings(
            tile_url=cfg.dashboard_tile_url,
            client_auth=cfg.client_auth,
            registration=cfg.open_registration,
        )
        bodies = BodyLimits(
            timeout_s=cfg.http_body_timeout_s,
            min_rate=cfg.http_body_min_rate,
            per_source=cfg.http_bodies_per_source,
            per_identity=cfg.http_bodies_per_identity,
        )
        http_runner = HttpApi(  # bounded (see HttpApi.runner)
            qs.client_call,
            qs.status,
            dashboard=settings,
            authenticate=qs.authenticate,
            bodies=bodies,
            proxies=qs.proxies,
        ).runner()
        await http_runner.setup()
        # HTTPS with the queue server's certificate (clients have none); plaintext when insecure
        await web.TCPSite(
            http_runner, host or "0.0.0.0", int(port), ssl_context=security.server_ssl(mutual=False)
        ).start()
    agent = None
    if cfg.discovery_port:
        core = DiscoveryCore(cfg.cluster_name, secrets.randbelow(1 << 53) + 1, "queue", cfg.address)
        core.member = True  # a queue server only announces itself
        agent = DiscoveryAgent(
            core,
            cfg.secret(),
            cfg.discovery_port,
            cfg.discovery_broadcast,
            cfg.discovery_seeds,
            listen=False,
        )
        await agent.start()
    if cfg.client_auth == "none":
        log.warning(
            "client_auth is none: every client may call everything, and client ids are "
            'whatever clients declare (give-to-get is forgeable); set client_auth = "token"'
        )
        print(
            "roadlog-queue: WARNING: client_auth = none: the client API checks no credential",
            file=sys.stderr,
        )
    expiry = asyncio.get_running_loop().create_task(qs.expire_loop())
    log.info(
        "queue server started",
        extra={"listen": cfg.listen, "http": cfg.http_listen, "metrics_port": cfg.metrics_port},
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if started is not None:
        started.set()
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    expiry.cancel()
    if agent is not None:
        await agent.stop()
    if http_runner is not None:
        await http_runner.cleanup()
    link_closed = (
        qs.publish_link.close(grace=1.0) if qs.publish_link is not None else asyncio.sleep(0)
    )
    await asyncio.gather(server.stop(grace=1.0), link_closed)
    if qs.frames is not None:
        await qs.frames.close()
    log.info("stopped")
