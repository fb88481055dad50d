"""The web dashboard on the queue server's HTTP port: ``GET /`` (or
``/ui/``) serves a page (``static/``: its script, styles and a vendored
Leaflet, nothing from elsewhere at run time) that draws a topic's latest
heat map on a street map, follows new heat maps without a reload, and shows
the cluster.

Its JSON, under ``/ui/api/``, goes through the same queues as the API:

- ``config``: the tile URL (``dashboard_tile_url``; empty: a plain
  background), how often the page polls, whether clients need a token
  (``client_auth``) and whether the page may register an identity of its
  own (``registration``: ``open_registration`` with tokens on);
- ``identity``: who the page's token is (name, client id, scopes): 401 for
  no token or one the cluster does not know, so a page can tell a token kept
  from another cluster and register anew;
- ``cluster``: the nodes (role, term, commit and applied index, lag behind
  the leader's commit, readiness, release), each Raft group (leader, term,
  commit, and each replica's lag: the group leader's commit minus that
  replica's applied, as ``roadlog cluster status`` shows it), the queue
  servers, and the topics with
  their ingest rate over the last minute (from the topics' end offsets,
  sampled when a page asks, at most once a second);
- ``heatmap?topic=T&client_id=C[&window_start_ms=W]``: the heat map as
  GeoJSON cells with their figures, the region's outline and the newest
  SLIDER_WINDOWS windows the cluster keeps (the slider's), under
  give-to-get (a stranger's 403 carries the API's reason). Its ETag names
  the map and the latest window: a page polls with ``If-None-Match`` and
  gets 304 until a new heat map is committed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from queue_server.auth import Caller
from queue_server.config import DEFAULT_TILE_URL
from roadlog.errors import Code, RoadlogError
from roadlog.heatmap_render import geojson
from roadlog.limits import MAX_PAGE_SIZE
from roadlog.status import node_json, raft_group_views
from roadlog.v1 import client_pb2

if TYPE_CHECKING:
    from queue_server.http_api import HttpApi

STATIC = Path(__file__).resolve().parent / "static"
RATE_SPAN_S = 60.0
SAMPLE_EVERY_S = 1.0
# The windows the slider offers: the newest 240 (4 hours of the stream's 60 s
# triggers, 2.5 days of 15-minute windows), not the thousands a topic keeps.
SLIDER_WINDOWS = 240
MAX_TOPICS = 1000  # the cluster panel lists at most this many topics
CACHED_MAPS = 16  # GeoJSON of the heat maps served last, by ETag
REGION_TTL_S = 30.0
MAX_CLIENT_ID = 128


@dataclass
class DashboardSettings:
    tile_url: str = DEFAULT_TILE_URL
    poll_ms: int = 2000
    client_auth: str = "token"  # "none": no identities, client ids as declared
    registration: bool = True  # POST /v1/clients is open (the page may register itself)


class IngestRates:
    """Pings stored per second over the last minute, per topic, from
    samples of each topic's total of end offsets (offsets are dense and
    never reused, so the difference is what was appended)."""

    def __init__(self, span_s: float = RATE_SPAN_S) -> None:
        self.span_s = span_s
        self.samples: deque[tuple[float, dict[str, int]]] = deque()

    def add(self, t: float, totals: dict[str, int]) -> None:
        self.samples.append((t, totals))
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.span_s:
            self.samples.popleft()

    def rates(self) -> dict[str, dict[str, float]]:
        """Per topic: pings per second and the seconds it is measured over
        (less than a minute while the samples are younger)."""
        if len(self.samples) < 2:
            return {}
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        dt = max(t1 - t0, 1e-3)
        return {
            name: {"pings_per_s": max(0, total - first.get(name, total)) / dt, "over_s": dt}
            for name, total in last.items()
        }


class Dashboard:
    def __init__(self, api: HttpApi, settings: DashboardSettings | None = None) -> None:
        self.api = api
        self.settings = settings or DashboardSettings()
        self.rates = IngestRates()
        self.last_sample = 0.0
        self.topics: list[dict[str, Any]] = []
        self.maps: OrderedDict[str, bytes] = OrderedDict()
        self.regions: dict[str, tuple[float, Any]] = {}

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/", self.page)
        r.add_get("/ui", self.to_ui)
        r.add_get("/ui/", self.page)
        r.add_get("/ui/api/config", self.config)
        r.add_get("/ui/api/identity", self.identity)
        r.add_get("/ui/api/cluster", self.cluster)
        r.add_get("/ui/api/heatmap", self.heatmap)
        r.add_static("/ui/static/", STATIC, append_version=False)

    async def page(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def to_ui(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/ui/")

    async def config(self, request: web.Request) -> web.Response:
        s = self.settings
        tokens = s.client_auth != "none"
        return web.json_response(
            {
                "tile_url": s.tile_url,
                "poll_ms": s.poll_ms,
                "client_auth": s.client_auth,
                "registration": tokens and s.registration,
            }
        )

    async def identity(self, request: web.Request) -> web.Response:
        """The token's identity (its route needs a token: the middleware
        answers 401 for none or an unknown one before this runs)."""
        authenticate = self.api._authenticate
        if authenticate is None:  # client_auth none: nobody in particular
            return web.json_response({"client_auth": "none"})
        caller = Caller(request.headers.get("Authorization"), self.api.source(request))
        p = await authenticate(caller)
        if p is None:
            return web.json_response({"client_auth": "none"})
        return web.json_response(
            {
                "client_auth": "token",
                "name": p.name,
                "client_id": p.client_id,
                "scopes": sorted(p.scopes),
            }
        )

    async def cluster(self, request: web.Request) -> web.Response:
        st: client_pb2.ClusterStatus = self.api.layout(request)  # addresses: admin or ops
        leader_commit = max(
            (n.commit_index for n in st.nodes if n.id == st.leader),
            default=max((n.commit_index for n in st.nodes), default=0),
        )
        nodes = [{**node_json(n), "lag": max(0, leader_commit - n.applied_index)} for n in st.nodes]
        # The route needs an identity (as Status); the topics are asked for
        # with it (ListTopics), so a token revoked meanwhile sees the nodes only.
        try:
            resp = await self.api.call(
                request, "ListTopics", client_pb2.ListTopicsRequest(page_size=MAX_PAGE_SIZE)
            )
        except RoadlogError as e:
            if e.code not in (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED):
                raise
            return web.json_response(self._cluster_json(st, nodes, [], hidden=e.message))
        topics = [
            {
                "name": d.topic.spec.name,
                "partitions": d.topic.spec.partitions,
                "pings": sum(p.next_offset - p.first_offset for p in d.partitions),
                "appended": sum(p.next_offset for p in d.partitions),
            }
            for d in list(resp.topics)[:MAX_TOPICS]
        ]
        now = time.monotonic()
        if now - self.last_sample >= SAMPLE_EVERY_S:
            self.last_sample = now
            self.topics = topics
            self.rates.add(now, {t["name"]: t["appended"] for t in topics})
        return web.json_response(self._cluster_json(st, nodes, topics))

    def _cluster_json(
        self,
        st: client_pb2.ClusterStatus,
        nodes: list[dict[str, Any]],
        topics: list[dict[str, Any]],
        hidden: str = "",
    ) -> dict[str, Any]:
        rates = self.rates.rates()
        doc: dict[str, Any] = {
            "leader": st.leader,
            "term": st.term,
            "nodes": nodes,
            "groups": raft_group_views(nodes),
            "queue_servers": [
                {"grpc": q.grpc, "http": q.http, "version": q.version} for q in st.queue_servers
            ],
            "topics": [
                {
                    "name": t["name"],
                    "partitions": t["partitions"],
                    "pings": t["pings"],
                    "ingest_pings_per_s": round(rates[t["name"]]["pings_per_s"], 2)
                    if t["name"] in rates
                    else None,
                    "ingest_over_s": round(rates[t["name"]]["over_s"], 1)
                    if t["name"] in rates
                    else 0,
                }
                for t in topics
            ],
            "served_ms": int(time.time() * 1000),
        }
        if hidden:
            doc["topics_hidden"] = hidden  # why: no token, or one without the right
        return doc

    async def _region(self, request: web.Request, topic: str) -> Any:
        now = time.monotonic()
        cached = self.regions.get(topic)
        if cached and now - cached[0] < REGION_TTL_S:
            return cached[1]
        d = await self.api.call(
            request, "DescribeTopic", client_pb2.DescribeTopicRequest(name=topic)
        )
        region = json.loads(d.topic.spec.region_geojson)
        if len(self.regions) > MAX_TOPICS:
            self.regions.clear()
        self.regions[topic] = (now, region)
        return region

    async def heatmap(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        topic = q.get("topic", "")
        client = q.get("client_id", "")
        if not topic:
            raise RoadlogError(Code.INVALID_ARGUMENT, "say which topic: ?topic=NAME")
        if len(client.encode()) > MAX_CLIENT_ID:
            raise RoadlogError(
                Code.INVALID_ARGUMENT, f"client_id is longer than {MAX_CLIENT_ID} bytes"
            )
        try:
            window = int(q.get("window_start_ms", "0"))
        except ValueError:
            raise RoadlogError(Code.INVALID_ARGUMENT, "window_start_ms: an integer") from None
        req = client_pb2.GetHeatmapRequest(
            topic=topic, client_id=client, window_start_ms=window, max_windows=SLIDER_WINDOWS
        )
        resp = await self.api.call(request, "GetHeatmap", req, client)
        hm = resp.heatmap
        latest = resp.windows[-1] if resp.windows else 0
        etag = f'"{topic}-{hm.window_start_ms}-{hm.computed_ms}-{latest}-{len(resp.windows)}"'
        headers = {"ETag": etag, "Cache-Control": "no-cache"}
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers=headers)
        body = self.maps.get(etag)
        if body is None:
            if len(hm.cells.h3) > 2000:  # cell outlines: off the event loop when many
                doc = await asyncio.get_running_loop().run_in_executor(None, geojson, hm)
            else:
                doc = geojson(hm)
            doc["properties"] |= {
                "computed_ms": hm.computed_ms,
                "source_pings": hm.source_pings,
                "bbox": list(hm.bbox),
                "windows": list(resp.windows),
                "latest_window_start_ms": latest,
                "region": await self._region(request, topic),
            }
            body = json.dumps(doc, allow_nan=False).encode()
            self.maps[etag] = body
            while len(self.maps) > CACHED_MAPS:
                self.maps.popitem(last=False)
        return web.Response(body=body, content_type="application/json", headers=headers)
