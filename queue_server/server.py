"""The queue server: the sans-I/O ``WorkQueues`` with the clients' calls
waiting on them, between its client front (``client_front.py``) and the
nodes' sessions (``node_sessions.py``); ``serve.py`` wires the process.

Client requests are kept as bytes end to end: the queue server reads only
what routing needs (a fetch's fence), and the node that takes the work
parses the rest. A result that says "not here" (UNAVAILABLE: the node lost
leadership, say) sends the item back to the queue for another node, until
the client's deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from queue_server.auth import (
    Authenticator,
    Gate,
    Principal,
    RateLimit,
    RateLimited,
    TrustedProxies,
)
from queue_server.client_front import ClientFront
from queue_server.config import QueueConfig
from queue_server.metrics import (
    _DEPTH,
    _DEPTH_BYTES,
    _SPLIT_CALLS,
    _SPLIT_PARTS,
    _WAIT,
    ANSWERED,
    _taken,
)
from queue_server.node_sessions import NodeSessions
from queue_server.outgoing import Outgoing
from queue_server.parts import merge as merge_parts
from queue_server.publish_link import PublishLinkServer
from queue_server.queues import Item, QueueFull, WorkQueues
from roadlog.errors import Code, RoadlogError
from roadlog.limits import CLIENT_MESSAGE_BYTES
from roadlog.protowire import leading_varint
from roadlog.release import release
from roadlog.rpc import ROUTED, Kind
from roadlog.runtime import frames, tls
from roadlog.runtime.auth import cluster_token
from roadlog.v1 import client_pb2, work_pb2

# A read fenced beyond every node's commit index waits this long (the
# nodes' state may lag the write's answer a little) before it is refused.
FENCE_GRACE_S = 2.0


class QueueServer(ClientFront, NodeSessions):
    """The queues and the calls waiting on them; the client front and the
    nodes' sessions are its parts."""

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
        group: int | None = None,
    ) -> bytes:
        """Queue one request and wait for its answer; ``own``: the queue
        server's own (see ``Item.own``); ``group``: the Raft group whose
        leader (a write) or replica (a read) must take it (default: the
        publish's routing hint, else group 0)."""
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
        # A group's topic is checked by the node, with the caller's scopes;
        # and a self-registered caller's publishes (topics closed to open produce).
        registered = principal is not None and principal.registered
        shown = principal is not None and (rpc.group_topic or registered)
        scopes = tuple(sorted(principal.scopes)) if principal is not None and shown else ()
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
            scopes=scopes,
            registered=registered,
            group=self._group_hint(method, request) if group is None else group,
            own=own,
        )
        try:
            self.q.submit(item)
        except QueueFull as e:
            raise RoadlogError(Code.RESOURCE_EXHAUSTED, str(e)) from None
        res = await self._answer(item)
        if res.code and res.retry_after_ms:  # a node's rate ran out: as the server's own
            raise RateLimited(res.message, res.retry_after_ms / 1000)
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
        rpc = ROUTED.get(method)
        field = rpc.group_hint_field if rpc is not None else 0
        if not field:
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
            if wid in self.statuses:  # as the node built it (node_daemon/replica/status.py)
                ns.CopyFrom(self.statuses[wid])
            # the routing fields are newer: they ride on every result
            ns.id, ns.address, ns.term, ns.leader = s.node_id, s.address, s.term, s.leader
            ns.commit_index, ns.applied_index = s.commit_index, s.applied_index
        qs = st.queue_servers.add(grpc=self.cfg.address, version=release())
        if self.cfg.http_listen:
            scheme = "http" if tls.current().insecure else "https"
            qs.http = f"{scheme}://{self.cfg.http_listen}"
        return st
