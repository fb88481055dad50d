"""The queue server's client front: a client's call admitted (who calls,
may they, from where), self-registration and identities, the gRPC client
service and the publish link. The queues behind it are ``QueueServer``'s
(``queue_server.server``), of which ``ClientFront`` is a part."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from queue_server.auth import (
    V4_PREFIX,
    V6_PREFIX,
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
from queue_server.layout import layout_for
from queue_server.metrics import ANSWERED, PUBLISH_LINKS_REJECTED, REQUESTS, count_publish_batch
from queue_server.publish_link import PublishLinkServer
from queue_server.topic_home import NO_TOPIC, TopicHomes
from roadlog.errors import Code, RoadlogError
from roadlog.federation.home import HOME_HEADER, TopicElsewhere
from roadlog.grpc_status import to_grpc
from roadlog.rpc import BY_NAME, SERVICE
from roadlog.runtime import tls
from roadlog.scopes import new_token, token_hash
from roadlog.v1 import client_pb2, clients_pb2, topics_pb2, work_pb2

USED_PER_REPORT = 5_000  # names one ClientsUsed carries at most


class ClientFront:
    """The part of ``QueueServer`` that faces clients (see the module doc)."""

    cfg: QueueConfig
    gate: Gate
    registrations: RateLimit
    proxies: TrustedProxies
    states: dict[int, work_pb2.WorkerState]
    publish_link: PublishLinkServer | None
    # A federation member's: a topic homed elsewhere named where a node
    # knows no such topic (docs/federation.md); None: not a member.
    topic_homes: TopicHomes | None = None

    if TYPE_CHECKING:  # the queues' side, in QueueServer

        async def _call(
            self,
            method: str,
            request: bytes,
            timeout: float | None,
            client: str,
            principal: Principal | None,
            own: bool = False,
            group: int | None = None,
        ) -> bytes: ...

        async def call(
            self, method: str, request: bytes, timeout: float | None, client: str = ""
        ) -> bytes: ...

        def status(self) -> client_pb2.ClusterStatus: ...

    async def client_call(
        self, method: str, request: bytes, timeout: float | None, caller: Caller
    ) -> bytes:
        """A client's call (gRPC or HTTP): admitted by the gate (who calls,
        may they), then queued for a node with the caller's identity."""
        t0 = time.monotonic()
        outcome = "error"
        try:
            principal = await self.gate.admit(method, request, caller)
            answer = await self._admitted(method, request, timeout, caller, principal)
            outcome = "ok"
            return answer
        finally:
            ANSWERED.labels(method, outcome).observe(time.monotonic() - t0)

    async def _admitted(
        self,
        method: str,
        request: bytes,
        timeout: float | None,
        caller: Caller,
        principal: Principal,
    ) -> bytes:
        """An admitted call; a federation member's answer about a topic
        homed in another member names that home (``TopicHomes``)."""
        homes = self.topic_homes
        if homes is None:
            return await self._routed(method, request, timeout, caller, principal)
        try:
            answer = await self._routed(method, request, timeout, caller, principal)
        except RoadlogError as e:
            await homes.check(method, request, e)
            raise
        if method == "PublishBatch" and NO_TOPIC in answer:
            answer = await homes.redirect_results(request, answer)
        return answer

    async def _routed(
        self,
        method: str,
        request: bytes,
        timeout: float | None,
        caller: Caller,
        principal: Principal,
    ) -> bytes:
        """Where the call goes: registration, ReadFences, or the queues."""
        if method in ("CreateClient", "RegisterClient"):
            answer = await self._new_client(method, request, timeout, caller)
        elif method == "ReadFences":
            lane = principal.client_id or caller.declared or caller.source
            answer = await self._read_fences(request, timeout, lane, principal)
        else:
            # Fair between identities; without one, between declared ids or addresses.
            lane = principal.client_id or caller.declared or caller.source
            answer = await self._call(method, request, timeout, lane, principal)
            if method == "RevokeClient":
                name = clients_pb2.RevokeClientRequest.FromString(request).name
                self.gate.auth.forget(name)  # here at once; elsewhere within the cache's TTL
        return answer

    async def _read_fences(
        self, request: bytes, timeout: float | None, lane: str, principal: Principal
    ) -> bytes:
        """Each group holding the topic's partitions asked for its commit
        index at its leader (a ``ReadIndex`` each, at once, in the caller's
        lane): what a read fenced on them must reflect."""
        try:
            topic = client_pb2.ReadFencesRequest.FromString(request).topic
        except Exception:
            raise RoadlogError(Code.INVALID_ARGUMENT, "malformed ReadFencesRequest") from None
        described = await self._call(
            "DescribeTopic",
            client_pb2.DescribeTopicRequest(name=topic).SerializeToString(),
            timeout,
            lane,
            principal,
        )
        placed = topics_pb2.TopicDescription.FromString(described).topic.partition_groups
        groups = sorted(set(placed)) or [0]  # a topic from before groups lies in group 0

        async def index_of(group: int) -> int:
            raw = await self._call(
                "ReadIndex",
                client_pb2.ReadIndexRequest(group=group).SerializeToString(),
                timeout,
                lane,
                principal,
                group=group,
            )
            return client_pb2.ReadIndexResponse.FromString(raw).index

        indexes = await asyncio.gather(*(index_of(g) for g in groups))
        resp = client_pb2.ReadFencesResponse()
        for g, index in zip(groups, indexes, strict=True):
            if g:
                resp.group_fences.add(group=g, applied_index=index)
            else:
                resp.applied_index = index
        return resp.SerializeToString()

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
            if req.token_hash:
                # An admin's own token, given as its hash: one token for the
                # identity on every cluster of a federation (`roadlog client
                # create --directory`, docs/federation.md); none is told back.
                if len(req.token_hash) != len(token_hash(token)):
                    raise RoadlogError(Code.INVALID_ARGUMENT, "token_hash: a SHA-256 (32 bytes)")
                token = ""
            else:
                req.token_hash = token_hash(token)
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

    async def report_used_loop(self) -> None:
        """Every ``clients_used_report_s``, ``report_used``."""
        while True:
            await asyncio.sleep(self.cfg.clients_used_report_s)
            await self.report_used()

    async def report_used(self) -> None:
        """Tell group 0's leader which self-registered identities were used
        (``UsedReport``: each at most once a day); its next trim records
        them. What could not be told is told next time."""
        used = self.gate.auth.used
        while names := used.take(USED_PER_REPORT):
            req = clients_pb2.ClientsUsedRequest(names=names)
            try:
                await self.call("ClientsUsed", req.SerializeToString(), 10.0, "clients-used")
            except RoadlogError:
                used.give_back(names)
                return

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


def client_handler(server: ClientFront) -> grpc.GenericRpcHandler:
    """The Roadlog service with requests and responses kept as bytes."""

    def unary(method: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        async def handle(request: bytes, context: Any) -> bytes:
            remaining = context.time_remaining()
            try:
                caller = caller_of(context, server.proxies)
                out = await server.client_call(method, request, remaining, caller)
            except RoadlogError as e:
                REQUESTS.labels(method, e.code.name).inc()
                home = ((HOME_HEADER, e.home.header),) if isinstance(e, TopicElsewhere) else ()
                await context.abort(to_grpc(e.code), e.message, home)
            REQUESTS.labels(method, "OK").inc()
            return out

        return handle

    async def status(request: bytes, context: Any) -> bytes:
        try:
            who = await server.gate.admit("Status", request, caller_of(context, server.proxies))
        except RoadlogError as e:
            REQUESTS.labels("Status", e.code.name).inc()
            await context.abort(to_grpc(e.code), e.message)
        REQUESTS.labels("Status", "OK").inc()
        seen = layout_for(server.status(), who if server.gate.enabled else None)
        return seen.SerializeToString()

    # Answered here (Status) or by the client front itself (ReadFences); the
    # rest go through the queues.
    local: dict[str, Callable[[bytes, Any], Awaitable[bytes]]] = {"Status": status}
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        name: grpc.unary_unary_rpc_method_handler(local.get(name) or unary(name))
        for name in BY_NAME
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)
