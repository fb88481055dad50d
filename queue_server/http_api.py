"""The HTTP/JSON API of the queue server: the same operations as gRPC, for
phones and in-car units. Each request becomes the same protobuf request the
gRPC API takes and goes through the same queues.

Errors are JSON ``{"error": {"code": "...", "reason": "..."}}``: 4xx when the
client is at fault, 503 with Retry-After when there is no leader or the
queues are full, 504 when no answer came before the deadline.

Connections are bounded (issue 19, finding 12) with aiohttp's server knobs
(``runner``): a connection with no complete request line and headers within
``IDLE_TIMEOUT_S`` of its start or of the previous answer is closed
(aiohttp's ``keepalive_timeout``, which in the aiohttp we lock, 3.14, also
runs from the start of a connection and is not reset by the bytes of a
request still incomplete: aiohttp has no separate header-read timeout), and request
lines, header fields and the number of headers are limited
(``max_line_size``, ``max_field_size``, ``max_headers``). aiohttp has no
body-read timeout either: a body that stops arriving (no byte of it for
``BODY_IDLE_S``, as nginx's ``client_body_timeout``), that is not whole
within ``BodyLimits.timeout_s`` of its first read however it trickles, or
that arrives slower than ``BodyLimits.min_rate`` bytes a second once
``RATE_GRACE_S`` have passed, is answered 408 here, and the connection is
closed after at most ``LINGER_S`` (``lingering_time``: how long aiohttp
reads and drops the rest of a body it did not use). At most
``BodyLimits.per_source`` bodies are read at once from one address and
``per_identity`` for one identity: one more is answered 429 with
Retry-After, unread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web
from google.protobuf.message import Message
from prometheus_client import Counter

from queue_server.auth import (
    Caller,
    Principal,
    RateLimited,
    TrustedProxies,
    check_need,
    route_need,
)
from queue_server.dashboard import Dashboard, DashboardSettings
from queue_server.layout import layout_for
from queue_server.openapi import OPENAPI
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.contribution import min_pings, min_seconds
from roadlog.errors import Code, RoadlogError
from roadlog.federation.home import HOME_HEADER, TopicElsewhere
from roadlog.geo import RegionError, bbox_region, parse_region
from roadlog.limits import HTTP_BODY_BYTES, MAX_PAGE_SIZE
from roadlog.partitioning import ping_groups
from roadlog.protowire import with_leading_varint
from roadlog.rpc import BY_NAME, PUBLIC, RPCS
from roadlog.status import node_json
from roadlog.v1 import client_pb2, clients_pb2, topics_pb2
from roadlog.validation import MAX_BATCH_PINGS

log = logging.getLogger("roadlog.http")

ABANDONED = Counter(
    "roadlog_http_requests_abandoned_total",
    "HTTP requests whose client closed the connection before they were whole (a body abandoned)",
)

MAX_FETCH_PINGS = 100_000
MAX_GROUP_FENCES = 64  # one per data group at most
MAP_TTL_S = 10.0  # how long a topic's partition -> group map is used before it is read again
MAX_MAPS = 1024  # topics' maps kept at most
MAX_CLIENT_ID = 128
RETRY_AFTER_S = "1"
TIMEOUT_HEADER = "X-Timeout-Ms"
# The deadline as a wall-clock time (Unix ms): unlike the timeout, it also
# counts what passed before this server read the request (a backlog, a
# restart, a pause). The earlier of the two holds.
DEADLINE_HEADER = "X-Deadline-Unix-Ms"
MAX_TIMEOUT_S = 600.0  # the longest deadline either header may set
IDLE_TIMEOUT_S = 10.0  # no complete request (line + headers) for this long: closed
BODY_IDLE_S = 10.0  # no byte of a request body for this long: 408
RATE_GRACE_S = 5.0  # a body's rate is judged once it has been read this long
LINGER_S = 2.0  # the unread rest of a body (after 408, 413, 404 ...) is drained this long at most
MAX_LINE_BYTES = 8190  # the request line (aiohttp's default, stated)
MAX_FIELD_BYTES = 8190  # one header field
MAX_HEADERS = 64

# roadlog's codes as HTTP statuses (the HTTP edge of roadlog.errors); 500 else.
HTTP_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.OUT_OF_RANGE: 400,
    Code.PERMISSION_DENIED: 403,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.FAILED_PRECONDITION: 409,
    Code.RESOURCE_EXHAUSTED: 503,
    Code.UNAVAILABLE: 503,
    Code.DEADLINE_EXCEEDED: 504,
    Code.UNIMPLEMENTED: 501,
    Code.UNAUTHENTICATED: 401,
}

Call = Callable[[str, bytes, float | None, Caller], Awaitable[bytes]]
# The identity ``_credential_first`` found for a request (None: client_auth none).
PRINCIPAL: web.RequestKey[Principal | None] = web.RequestKey("principal")


@dataclass(frozen=True)
class BodyLimits:
    """How long a request body may take, how slowly it may come, and how
    many may be read at once (the queue server's ``http_body_*`` keys)."""

    timeout_s: float = 30.0  # a body is whole within this of its first read
    min_rate: int = 1024  # bytes a second, judged after RATE_GRACE_S
    per_source: int = 64  # bodies read at once from one address (phones behind a NAT share one)
    per_identity: int = 8  # ... for one identity


# What each HTTP route that is not an rpc's (roadlog.rpc) needs: "public",
# or "rpc:NAME", the rules of the rpc it calls (roadlog.rpc's needs).
# tests/unit/queue_server/test_client_auth.py checks that every route has a rule.
ROUTE_RULES: dict[str, str] = {
    "/openapi.json": "public",
    "/healthz": "public",
    "/": "public",
    "/ui": "public",
    "/ui/": "public",
    "/ui/static/": "public",
    "/ui/api/config": "public",
    "/ui/api/identity": "rpc:ListTopics",  # as ListTopics: any identity, no scope; 401 else
    "/ui/api/cluster": "rpc:Status",  # as Status: any identity, no scope; 401 else
    "/ui/api/heatmap": "rpc:GetHeatmap",
}


_RPC_ROUTES = {(r.http.method, r.http.path): r for r in RPCS if r.http is not None}


def route_rule(request: web.Request) -> str:
    """What the request's route needs: an rpc's ``needs``, or its rule in
    ROUTE_RULES ("public" for a path that matches no route)."""
    info = request.match_info
    path = info.route.resource.canonical if info.route.resource is not None else ""
    rpc = _RPC_ROUTES.get((request.method, path))
    if rpc is not None:
        return rpc.needs
    return ROUTE_RULES.get(path, PUBLIC)


def error_response(status: int, code: str, reason: str) -> web.Response:
    headers: dict[str, str] | None = None
    if status == 503:
        headers = {"Retry-After": RETRY_AFTER_S}
    elif status == 401:
        headers = {"WWW-Authenticate": 'Bearer realm="roadlog"'}
    return web.json_response(
        {"error": {"code": code, "reason": reason}}, status=status, headers=headers
    )


def content_security_policy(tile_url: str) -> str:
    """The page's and the API's CSP: everything from this origin only, but
    the street map's tiles (``tile_url``'s origin, ``{s}`` a wildcard
    subdomain), no framing, no plugins, no base or form elsewhere."""
    img = ["'self'", "data:", "blob:"]
    head = tile_url.split("/", 3)
    if tile_url.startswith(("http://", "https://")) and len(head) >= 3 and head[2]:
        img.append(f"{head[0]}//{head[2].replace('{s}', '*')}")
    return "; ".join(
        [
            "default-src 'self'",
            f"img-src {' '.join(img)}",
            "style-src 'self'",
            "script-src 'self'",
            "connect-src 'self'",
            "object-src 'none'",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        ]
    )


def security_headers(tile_url: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware that sends every answer (the page, its files, the API,
    errors and redirects) with CSP, X-Content-Type-Options,
    Referrer-Policy and X-Frame-Options (issue 39, finding 6)."""
    headers = {
        "Content-Security-Policy": content_security_policy(tile_url),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
    }

    @web.middleware
    async def add(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            resp = await handler(request)
        except web.HTTPException as e:  # a redirect passed on as an exception
            e.headers.update(headers)
            raise
        if not resp.prepared:
            resp.headers.update(headers)
        return resp

    return add


def elsewhere_response(e: TopicElsewhere, request: web.Request) -> web.Response:
    """307 to the same path and query on the topic's home (its first HTTP
    API), with ``roadlog-topic-home``; without an HTTP API there, the JSON
    refusal with the header alone."""
    if e.home.http:
        resp = error_response(307, e.code.name, e.message)
        resp.headers["Location"] = e.home.http[0].rstrip("/") + request.path_qs
    else:
        resp = error_response(HTTP_STATUS.get(e.code, 500), e.code.name, e.message)
    resp.headers[HOME_HEADER] = e.home.header
    return resp


def bad(reason: str) -> RoadlogError:
    return RoadlogError(Code.INVALID_ARGUMENT, reason)


@web.middleware
async def errors_as_json(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except RateLimited as e:  # a rate ran out: 429, and when to come back
        resp = error_response(429, e.code.name, e.message)
        resp.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
        return resp
    except TopicElsewhere as e:  # federation: the topic's home, where the same path answers
        return elsewhere_response(e, request)
    except RoadlogError as e:  # roadlog's one error type, mapped at this edge
        return error_response(HTTP_STATUS.get(e.code, 500), e.code.name, e.message)
    except web.HTTPException as e:  # 404 for unknown paths, 405, 413 ...
        if e.status < 400:
            raise
        code = {
            404: "NOT_FOUND",
            405: "METHOD_NOT_ALLOWED",
            408: "REQUEST_TIMEOUT",
            413: "PAYLOAD_TOO_LARGE",
            429: "RESOURCE_EXHAUSTED",
        }.get(e.status, "INVALID_ARGUMENT")
        resp = error_response(e.status, code, e.reason or e.text or "")
        if e.status == 429:
            resp.headers["Retry-After"] = e.headers.get("Retry-After", RETRY_AFTER_S)
        if e.status == 408:
            resp.force_close()  # the rest of a slow body is not waited for
        return resp
    except ConnectionError:  # the client went away mid-request (a body abandoned, say)
        ABANDONED.inc()  # counted, not logged: anyone can cause it at will
        return error_response(400, "CANCELLED", "the client closed the connection")
    except Exception as e:  # a bug: say so in JSON, keep serving
        log.exception("HTTP request failed", extra={"path": request.path})
        return error_response(500, "INTERNAL", f"{type(e).__name__}: {e}")


class HttpApi:
    def __init__(
        self,
        call: Call,
        status: Callable[[], client_pb2.ClusterStatus],
        body_idle_s: float = BODY_IDLE_S,
        dashboard: DashboardSettings | None = None,
        authenticate: Callable[[Caller], Awaitable[Principal | None]] | None = None,
        bodies: BodyLimits | None = None,
        proxies: TrustedProxies | None = None,
    ) -> None:
        self._call = call
        # Checks a caller's credential before its body is read or parsed
        # (the call checks it again, from the cache, with its scope).
        self._authenticate = authenticate
        self._status = status
        self.body_idle_s = body_idle_s
        self.bodies = bodies or BodyLimits()
        self.proxies = proxies or TrustedProxies()
        self._reading: dict[str, int] = {}  # bodies being read, by "source:.." and "id:.."
        self.dashboard = Dashboard(self, dashboard)
        # topic -> (when read, its partition -> data group map): to route a
        # publish whose pings lie in one data group straight to its leader.
        self._maps: dict[str, tuple[float, list[int]]] = {}

    def runner(
        self, idle_timeout_s: float = IDLE_TIMEOUT_S, linger_s: float = LINGER_S
    ) -> web.AppRunner:
        """The app with its connection bounds (see the module's doc)."""
        return web.AppRunner(
            self.app(),
            access_log=None,
            keepalive_timeout=idle_timeout_s,
            lingering_time=linger_s,
            max_line_size=MAX_LINE_BYTES,
            max_field_size=MAX_FIELD_BYTES,
            max_headers=MAX_HEADERS,
        )

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=HTTP_BODY_BYTES,
            middlewares=[
                security_headers(self.dashboard.settings.tile_url),
                errors_as_json,
                self._credential_first,
            ],
        )
        r = app.router
        r.add_get("/openapi.json", self.openapi)
        r.add_get("/healthz", self.healthz)
        self.dashboard.add_routes(app)  # the web page: /, /ui/
        # The rpcs with an HTTP route (roadlog.rpc), each by its handler here.
        for rpc in RPCS:
            if rpc.http is not None:
                handler = getattr(self, rpc.handler)
                if rpc.http.method == "GET":
                    r.add_get(rpc.http.path, handler)
                else:
                    r.add_route(rpc.http.method, rpc.http.path, handler)
        return app

    @web.middleware
    async def _credential_first(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """A route that needs a token has it checked before anything else,
        and the scope for the topic its path names (the call checks both
        again, from the cache, against the request it makes)."""
        rule = route_rule(request)
        if self._authenticate is not None and rule != PUBLIC:
            caller = Caller(request.headers.get("Authorization"), self.source(request))
            principal = await self._authenticate(caller)
            request[PRINCIPAL] = principal
            rpc = BY_NAME.get(rule.removeprefix("rpc:"))
            needs = rpc.needs if rpc is not None else rule
            topic = request.match_info.get("name") or request.query.get("topic", "")
            need = route_need(needs, topic)
            if principal is not None and need is not None:
                check_need(principal, need, request.path)
        return await handler(request)

    async def call(
        self,
        request: web.Request,
        method: str,
        req: Any,
        client: str = "",
        response: type[Message] | None = None,
    ) -> Any:
        """Through the queues like a gRPC call; the deadline from the
        ``X-Timeout-Ms`` and ``X-Deadline-Unix-Ms`` headers, the earlier
        (else the queue server's default). The answer is the rpc's response
        message (or ``response``, a view of it)."""
        timeout = request_timeout(request.headers, time.time())
        caller = Caller(request.headers.get("Authorization"), self.source(request), client)
        wire = req if isinstance(req, bytes) else req.SerializeToString()
        raw = await self._call(method, wire, timeout, caller)
        return (response or BY_NAME[method].response).FromString(raw)

    async def _data_group(
        self, request: web.Request, topic: str, cols: PingColumns, client: str
    ) -> int:
        """The data group all of a publish's pings lie in (a phone's, one
        device, always does), for a topic placed in data groups; 0 when they
        span groups, the topic is group 0's, or its map cannot be read (the
        publish then goes the general way). Maps are kept MAP_TTL_S."""
        now = time.monotonic()
        hit = self._maps.get(topic)
        if hit is None or now - hit[0] > MAP_TTL_S:
            try:
                d = await self.call(
                    request, "DescribeTopic", client_pb2.DescribeTopicRequest(name=topic), client
                )
            except RoadlogError:
                return 0  # the publish answers for itself
            if len(self._maps) >= MAX_MAPS:
                self._maps.clear()
            hit = self._maps[topic] = (now, list(d.topic.partition_groups))
        groups = hit[1]
        if not groups or len(cols) == 0:
            return 0
        per_ping = ping_groups(cols, groups)
        return int(per_ping[0]) if bool((per_ping == per_ping[0]).all()) else 0

    def source(self, request: web.Request) -> str:
        """The caller's address: the peer's, or from a trusted proxy the one
        its ``X-Forwarded-For`` names (``TrustedProxies``)."""
        return self.proxies.client(request.remote or "", request.headers.get("X-Forwarded-For"))

    @contextmanager
    def _body_slot(self, request: web.Request) -> Iterator[None]:
        """One of the bodies read at once for the request's source and
        identity, or 429 with Retry-After (the body left unread)."""
        principal = request.get(PRINCIPAL)
        keys = ["source:" + self.source(request)]
        if isinstance(principal, Principal) and principal.client_id:
            keys.append("id:" + principal.client_id)
        caps = [self.bodies.per_source, self.bodies.per_identity]
        for key, cap in zip(keys, caps, strict=False):
            if self._reading.get(key, 0) >= cap:
                who = "this address" if key.startswith("source:") else "this identity"
                raise web.HTTPTooManyRequests(
                    reason=f"{cap} request bodies are being read for {who} already: retry",
                    headers={"Retry-After": RETRY_AFTER_S},
                )
        for key in keys:
            self._reading[key] = self._reading.get(key, 0) + 1
        try:
            yield
        finally:
            for key in keys:
                self._reading[key] -= 1
                if not self._reading[key]:
                    del self._reading[key]

    async def _body(self, request: web.Request) -> bytes:
        """The request's body, read under the body limits (the module's doc)."""
        with self._body_slot(request):
            return await _read_body(request, self.body_idle_s, self.bodies)

    async def _json_object(self, request: web.Request) -> dict[str, Any]:
        return await _json_object_of(await self._body(request))

    # -------------------------------------------------------------- handlers

    def layout(self, request: web.Request) -> client_pb2.ClusterStatus:
        """The cluster's status as the caller may see it (``layout_for``:
        node addresses for admin or ops only)."""
        principal = request.get(PRINCIPAL)
        return layout_for(self._status(), principal if isinstance(principal, Principal) else None)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(OPENAPI)

    async def healthz(self, request: web.Request) -> web.Response:
        st = self._status()
        return web.json_response({"ok": True, "leader": st.leader})

    async def status(self, request: web.Request) -> web.Response:
        st = self.layout(request)
        return web.json_response(
            {
                "leader": st.leader,
                "term": st.term,
                "nodes": [node_json(n) for n in st.nodes],
                "queue_servers": [{"grpc": q.grpc, "http": q.http} for q in st.queue_servers],
            }
        )

    async def create_topic(self, request: web.Request) -> web.Response:
        body = await self._json_object(request)
        name = _str(body, "name", required=True, max_len=63)
        region = body.get("region")
        bbox = body.get("bbox")
        try:
            if region is not None and bbox is None:
                if not isinstance(region, dict):
                    raise bad("region must be a GeoJSON object (a Polygon or a Feature)")
                geojson = (
                    await asyncio.get_running_loop().run_in_executor(None, parse_region, region)
                ).geojson
            elif bbox is not None and region is None:
                if not (
                    isinstance(bbox, list) and len(bbox) == 4 and all(_is_number(v) for v in bbox)
                ):
                    raise bad("bbox must be [min_lon, min_lat, max_lon, max_lat]")
                geojson = bbox_region(*(float(v) for v in bbox)).geojson
            else:
                raise bad("give exactly one of region (GeoJSON) and bbox")
        except RegionError as e:
            raise bad(str(e)) from None
        spec = topics_pb2.TopicSpec(
            name=name,
            region_geojson=geojson,
            partitions=_int(body, "partitions", 0, 0, 256),
            retention_ms=_int(body, "retention_ms", 0, 0, 10 * 365 * 86_400_000),
            h3_resolution=_int(body, "h3_resolution", 0, 0, 15),
            contribution_window_ms=_int(body, "contribution_window_ms", 0, 0, 30 * 86_400_000),
            no_open_produce=body.get("no_open_produce") is True,
        )
        if body.get("no_open_produce") not in (None, True, False):
            raise bad("no_open_produce must be true or false")
        for key in ("contribution_min_pings", "contribution_min_seconds"):
            if body.get(key) is not None:  # absent: the default (the node's)
                setattr(spec, key, _int(body, key, 0, 0, 30 * 86_400))
        d = await self.call(request, "CreateTopic", client_pb2.CreateTopicRequest(spec=spec))
        return web.json_response({**topic_json(d), "applied_index": d.applied_index}, status=201)

    async def list_topics(self, request: web.Request) -> web.Response:
        resp = await self.call(
            request,
            "ListTopics",
            client_pb2.ListTopicsRequest(
                min_applied_index=_fence(request),
                group_fences=_group_fences(request),
                page_size=_query_int(
                    request.query.get("page_size", "0"), "page_size", 0, MAX_PAGE_SIZE
                ),
                page_token=request.query.get("page_token", ""),
            ),
        )
        body: dict[str, Any] = {"topics": [topic_json(d) for d in resp.topics]}
        if resp.next_page_token:
            body["next_page_token"] = resp.next_page_token
        return web.json_response(body)

    async def describe_topic(self, request: web.Request) -> web.Response:
        d = await self.call(
            request,
            "DescribeTopic",
            client_pb2.DescribeTopicRequest(
                name=request.match_info["name"],
                min_applied_index=_fence(request),
                group_fences=_group_fences(request),
            ),
        )
        return web.json_response(topic_json(d))

    async def init_producer(self, request: web.Request) -> web.Response:
        """An idempotent producer id for HTTP publishes (as gRPC's
        InitProducer): a publish that names it and a sequence is stored
        once however often it is sent again. With the ``producer_id`` of an
        id this client holds: that id under its next epoch (publishes under
        older epochs are refused from then on)."""
        body = await self._json_object(request)
        client = _str(body, "client_id", required=True, max_len=MAX_CLIENT_ID)
        resume = _int(body, "producer_id", 0, 0, 2**64 - 1)
        init = client_pb2.InitProducerRequest(client_id=client, producer_id=resume)
        resp = await self.call(request, "InitProducer", init, client)
        return web.json_response({"producer_id": resp.producer_id, "epoch": resp.epoch}, status=201)

    async def publish(self, request: web.Request) -> web.Response:
        body = await self._json_object(request)
        # With a token, the identity it names publishes (what a body says
        # is not believed: the nodes store the token's identity): no
        # client_id needed. Without identities (client_auth none) it is.
        principal = request.get(PRINCIPAL)
        named = principal.client_id if isinstance(principal, Principal) else ""
        client = _str(body, "client_id", required=not named, max_len=MAX_CLIENT_ID) or named
        producer_id = _int(body, "producer_id", 0, 0, 2**64 - 1)
        sequence = _int(body, "sequence", 0, 0, 2**63 - 1)
        epoch = _int(body, "producer_epoch", 0, 0, 2**32 - 1)
        if ("sequence" in body or "producer_epoch" in body) and not producer_id:
            raise bad("sequence and producer_epoch need a producer_id (POST /v1/producers)")
        pings = body.get("pings")
        if isinstance(pings, list) and len(pings) > 1000:  # seconds of work: off the loop
            loop = asyncio.get_running_loop()
            cols = await loop.run_in_executor(None, pings_from_json, pings)
        else:
            cols = pings_from_json(pings)
        topic = request.match_info["name"]
        req = client_pb2.PublishRequestView(  # the encoded batch as it is: no re-parse
            topic=topic,
            client_id=client,
            producer_id=producer_id,
            sequence=sequence,
            batch=columnar.encode(cols),
            producer_epoch=epoch,
        ).SerializeToString()
        group = await self._data_group(request, topic, cols, client)
        wire = with_leading_varint(req, BY_NAME["Publish"].group_hint_field, group)
        try:
            resp = await self.call(request, "Publish", wire, client)
        except RoadlogError as e:
            if not group or e.code != Code.FAILED_PRECONDITION or "map changed" not in e.message:
                raise
            self._maps.pop(topic, None)  # made again: the general way, which splits it
            resp = await self.call(request, "Publish", req, client)
        return web.json_response(
            {
                "offsets": [
                    {"partition": o.partition, "base_offset": o.base_offset, "count": o.count}
                    for o in resp.offsets
                ],
                "applied_index": resp.applied_index,
                "count": sum(o.count for o in resp.offsets),
                "duplicate": resp.duplicate,
                # A topic placed in data groups: each group's index (JSON keys are strings).
                "group_fences": {str(f.group): f.applied_index for f in resp.group_fences},
            }
        )

    async def fetch(self, request: web.Request) -> web.Response:
        """One partition's pings from an offset. A read that names no fence
        starts as a read to the end does: fenced on the partition's group's
        commit index at its leader (``ReadFences``), so no replica still
        catching up answers with an end short of what was acknowledged. The
        answer tells what its replica had applied (``group_fences``, also
        as the ``X-Roadlog-Group-Fences`` header, ``GROUP:INDEX,...``, and
        ``X-Roadlog-Applied-Index``): a reader that passes them back with
        its next page is never shown an end before one it saw."""
        q = request.query
        topic = request.match_info["name"]
        partition = _query_int(request.match_info["partition"], "partition", 0, 255)
        fence, group_fences = _fence(request), _group_fences(request)
        if not fence and not group_fences:
            learned = await self.call(
                request, "ReadFences", client_pb2.ReadFencesRequest(topic=topic)
            )
            fence, group_fences = learned.applied_index, list(learned.group_fences)
        req = client_pb2.FetchRequest(
            topic=topic,
            partition=partition,
            offset=_query_int(q.get("offset", "0"), "offset", 0, 2**63 - 1),
            max_pings=_query_int(q.get("limit", "1000"), "limit", 1, MAX_FETCH_PINGS),
            min_applied_index=fence,
            group_fences=group_fences,
        )
        resp = await self.call(request, "Fetch", req, response=client_pb2.FetchResponseView)
        pings: list[dict[str, Any]] = []
        for b in resp.batches:
            pings += pings_to_json(columnar.decode(b.batch), partition, b.base_offset)
        pings = pings[: req.max_pings]
        served = {f.group: f.applied_index for f in group_fences}
        for f in resp.group_fences:
            served[f.group] = max(served.get(f.group, 0), f.applied_index)
        applied = max(fence, resp.applied_index)
        return web.json_response(
            {
                "pings": pings,
                "next_offset": pings[-1]["offset"] + 1 if pings else resp.next_offset,
                "end_offset": resp.end_offset,
                "first_offset": resp.first_offset,
                "served_by": resp.served_by,
                "group_fences": {str(g): i for g, i in sorted(served.items())},
                "applied_index": applied,
            },
            headers=_fence_headers(served, applied),
        )

    async def read_fences(self, request: web.Request) -> web.Response:
        """What a read must start from to see every ping acknowledged before
        it began: each group's commit index at its leader."""
        resp = await self.call(
            request, "ReadFences", client_pb2.ReadFencesRequest(topic=request.match_info["name"])
        )
        served = {f.group: f.applied_index for f in resp.group_fences}
        return web.json_response(
            {
                "group_fences": {str(g): i for g, i in sorted(served.items())},
                "applied_index": resp.applied_index,
            },
            headers=_fence_headers(served, resp.applied_index),
        )

    async def register_client(self, request: web.Request) -> web.Response:
        """A phone's own identity (open self-registration): its client id and
        token, with the scopes produce:* and heatmap:*. The body, if any, is
        an empty JSON object."""
        raw = await self._body(request)
        if raw.strip():
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):
                raise bad("the body is not JSON") from None
            if body != {}:
                raise bad("the body must be empty or {}: a phone chooses nothing")
        resp = await self.call(request, "RegisterClient", clients_pb2.RegisterClientRequest())
        return web.json_response(
            {
                "client_id": resp.client_id,
                "token": resp.token,
                "scopes": list(resp.identity.scopes),
                "applied_index": resp.applied_index,
            },
            status=201,
        )

    async def get_heatmap(self, request: web.Request) -> web.Response:
        q = request.query
        req = client_pb2.GetHeatmapRequest(
            topic=request.match_info["name"],
            client_id=q.get("client_id", ""),
            window_start_ms=_query_int(q.get("window_start_ms", "0"), "window_start_ms", 0),
            min_applied_index=_fence(request),
            group_fences=_group_fences(request),
        )
        if len(req.client_id.encode()) > MAX_CLIENT_ID:
            raise bad(f"client_id is longer than {MAX_CLIENT_ID} bytes")
        resp = await self.call(request, "GetHeatmap", req)
        return web.json_response(heatmap_json(resp))


# ------------------------------------------------------------------ JSON


# Bodies bigger than this are parsed off the event loop (a 100,000-ping
# publish is about 10 MB of JSON: seconds of parsing that would stall both APIs).
INLINE_JSON_BYTES = 64 << 10


async def _read_body(request: web.Request, idle_s: float, limits: BodyLimits) -> bytes:
    """The whole body (``request.read``, with its size limit), or 408 once
    no byte of it arrived for ``idle_s``, it is not whole within
    ``limits.timeout_s``, or it comes slower than ``limits.min_rate``."""
    read = asyncio.ensure_future(request.read())
    loop = asyncio.get_running_loop()
    start = loop.time()
    received = first = request.content.total_bytes
    last_byte = start
    try:
        while True:
            done, _ = await asyncio.wait([read], timeout=min(1.0, idle_s))
            if done:
                return read.result()
            now = loop.time()
            total = request.content.total_bytes
            if total != received:
                received, last_byte = total, now
            if now - last_byte >= idle_s:
                raise web.HTTPRequestTimeout(
                    reason=f"no byte of the request body arrived for {idle_s:g} s"
                )
            if now - start >= limits.timeout_s:
                raise web.HTTPRequestTimeout(
                    reason=f"the request body was not whole within {limits.timeout_s:g} s"
                )
            rate = (received - first) / (now - start)
            if now - start >= RATE_GRACE_S and rate < limits.min_rate:
                raise web.HTTPRequestTimeout(
                    reason=f"the request body came at {rate:.0f} bytes/s, under the "
                    f"minimum of {limits.min_rate}"
                )
    finally:
        read.cancel()


async def _json_object_of(raw: bytes) -> dict[str, Any]:
    try:
        if len(raw) <= INLINE_JSON_BYTES:
            body = json.loads(raw)
        else:
            body = await asyncio.get_running_loop().run_in_executor(None, json.loads, raw)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise bad(f"the body is not JSON: {e}") from None
    except RecursionError:
        raise bad("the body is not JSON we accept: nested too deeply") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _str(body: dict[str, Any], key: str, required: bool = False, max_len: int = 256) -> str:
    v = body.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str) or not v:
        raise bad(f"{key} must be a non-empty string")
    if len(v.encode()) > max_len:
        raise bad(f"{key} is longer than {max_len} bytes")
    return v


def _int(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise bad(f"{key} must be an integer in {lo}..{hi}")
    return v


def request_timeout(headers: Mapping[str, str], now_unix: float) -> float | None:
    """Seconds left for a request by its headers at ``now_unix``: the
    earlier of ``X-Timeout-Ms`` (from now) and ``X-Deadline-Unix-Ms``; None
    when neither is given. A deadline already passed is answered at once:
    the client has stopped waiting (or its clock is wrong, which it is told)."""
    timeout = None
    if TIMEOUT_HEADER in headers:
        ms = _query_int(headers[TIMEOUT_HEADER], TIMEOUT_HEADER, 1, int(MAX_TIMEOUT_S * 1000))
        timeout = ms / 1000
    if DEADLINE_HEADER in headers:
        at_ms = _query_int(headers[DEADLINE_HEADER], DEADLINE_HEADER, 1, 2**53)
        left = at_ms / 1000 - now_unix
        if left <= 0:
            raise RoadlogError(
                Code.DEADLINE_EXCEEDED,
                f"{DEADLINE_HEADER} passed {-left:.3f} s before this server read the request "
                "(by its clock): nothing was done",
            )
        left = min(left, MAX_TIMEOUT_S)
        timeout = left if timeout is None else min(timeout, left)
    return timeout


def _query_int(raw: str, name: str, lo: int, hi: int = 2**63 - 1) -> int:
    try:
        v = int(raw)
    except ValueError:
        raise bad(f"{name} must be an integer") from None
    if not lo <= v <= hi:
        raise bad(f"{name} must be in {lo}..{hi}")
    return v


_OPTIONAL = ("speed_mps", "heading_deg", "accuracy_m")


def pings_from_json(pings: Any) -> PingColumns:
    """JSON pings to columns; a clear error naming the first bad field.
    (Plausibility and the region are checked by the leader, as for gRPC.)"""
    if not isinstance(pings, list) or not pings:
        raise bad("pings must be a non-empty list")
    if len(pings) > MAX_BATCH_PINGS:
        raise bad(f"at most {MAX_BATCH_PINGS} pings per request")
    n = len(pings)
    devices: list[str] = []
    ts = np.empty(n, dtype=np.int64)
    lat = np.empty(n, dtype=np.float64)
    lon = np.empty(n, dtype=np.float64)
    opt = {k: np.full(n, np.nan, dtype=np.float32) for k in _OPTIONAL}
    for i, p in enumerate(pings):
        if not isinstance(p, dict):
            raise bad(f"pings[{i}] must be an object")
        d = p.get("device_id")
        if not isinstance(d, str) or not d:
            raise bad(f"pings[{i}].device_id must be a non-empty string")
        devices.append(d)
        t = p.get("ts_ms")
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**62:
            raise bad(f"pings[{i}].ts_ms must be milliseconds since the epoch")
        ts[i] = t
        for key, arr in (("lat", lat), ("lon", lon)):
            v = p.get(key)
            if not _is_number(v):
                raise bad(f"pings[{i}].{key} must be a number")
            arr[i] = v
        for key in _OPTIONAL:
            v = p.get(key)
            if v is not None:
                if not _is_number(v) or abs(v) > 1e30:
                    raise bad(f"pings[{i}].{key} must be a number or null")
                opt[key][i] = v
    return PingColumns.from_columns(devices, ts, lat, lon, **opt)


def pings_to_json(cols: PingColumns, partition: int, base: int) -> list[dict[str, Any]]:
    return [
        dict(zip(columnar.PING_FIELDS, r, strict=True))
        for r in columnar.rows(cols, partition, base)
    ]


def _fence(request: web.Request) -> int:
    """The read-your-writes fence a request asks for (0: none)."""
    return _query_int(
        request.query.get("min_applied_index", "0"), "min_applied_index", 0, 2**63 - 1
    )


GROUP_FENCES_HEADER = "X-Roadlog-Group-Fences"
APPLIED_INDEX_HEADER = "X-Roadlog-Applied-Index"


def _fence_headers(group_fences: dict[int, int], applied: int) -> dict[str, str]:
    """A read's fences as headers, in the form ``?group_fences=`` takes back."""
    out = {APPLIED_INDEX_HEADER: str(applied)}
    if group_fences:
        out[GROUP_FENCES_HEADER] = ",".join(f"{g}:{i}" for g, i in sorted(group_fences.items()))
    return out


def _group_fences(request: web.Request) -> list[client_pb2.GroupFence]:
    """``?group_fences=G:INDEX,...``: read your writes in a topic placed in
    data groups (a publish's ``group_fences``); 400 for anything else."""
    raw = request.query.get("group_fences", "")
    out: list[client_pb2.GroupFence] = []
    for item in filter(None, raw.split(",")):
        group, _, index = item.partition(":")
        if not (group.isdigit() and index.isdigit()) or len(out) >= MAX_GROUP_FENCES:
            raise bad(f"group_fences: {raw!r} is not GROUP:INDEX,... (at most {MAX_GROUP_FENCES})")
        g, i = int(group), int(index)
        if not 1 <= g < 2**32 or i >= 2**63:
            raise bad(f"group_fences: {item!r} is out of range")
        out.append(client_pb2.GroupFence(group=g, applied_index=i))
    return out


def topic_json(d: topics_pb2.TopicDescription) -> dict[str, Any]:
    s = d.topic.spec
    return {
        "name": s.name,
        "region": json.loads(s.region_geojson),
        "partitions": s.partitions,
        "retention_ms": s.retention_ms,
        "h3_resolution": s.h3_resolution,
        "contribution_window_ms": s.contribution_window_ms,
        "contribution_min_pings": min_pings(s),
        "contribution_min_seconds": min_seconds(s),
        "no_open_produce": s.no_open_produce,
        "created_ms": d.topic.created_ms,
        "bbox": list(d.topic.bbox),
        "partition_states": [
            {
                "partition": p.partition,
                "first_offset": p.first_offset,
                "next_offset": p.next_offset,
                "last_append_ms": p.last_append_ms,
            }
            for p in d.partitions
        ],
    }


def heatmap_json(resp: client_pb2.GetHeatmapResponse) -> dict[str, Any]:
    hm = resp.heatmap
    c = hm.cells
    return {
        "topic": hm.topic,
        "window_start_ms": hm.window_start_ms,
        "window_end_ms": hm.window_end_ms,
        "h3_resolution": hm.h3_resolution,
        "computed_ms": hm.computed_ms,
        "source_pings": hm.source_pings,
        "cells": [
            {
                "h3": f"{c.h3[i]:x}",
                "pings": c.pings[i],
                "devices": c.devices[i],
                "mean_speed_mps": columnar.optional(c.mean_speed_mps[i]),
                "free_flow_mps": columnar.optional(c.free_flow_mps[i]) if c.free_flow_mps else None,
                "congestion": columnar.optional(c.congestion[i]) if c.congestion else None,
            }
            for i in range(len(c.h3))
        ],
        "windows": list(resp.windows),
        "contributed_ms": resp.contributed_ms,
        "served_ms": int(time.time() * 1000),
    }
