"""The dashboard's server side, against a fake cluster behind the queues:
the page and its vendored files (nothing from elsewhere), the heat map as
GeoJSON with an ETag that changes only with a new heat map, give-to-get's
403 with the API's reason, the cluster panel's lag and ingest rates."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import h3
import pytest
from aiohttp.test_utils import TestClient, TestServer

from queue_server import dashboard
from queue_server.auth import Caller
from queue_server.dashboard import STATIC, DashboardSettings, IngestRates
from queue_server.http_api import HttpApi
from roadlog.errors import Code, RoadlogError
from roadlog.geo import bbox_region
from roadlog.v1 import client_pb2, heatmaps_pb2, topics_pb2

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
REGION = bbox_region(11.45, 48.08, 11.70, 48.20)
JAM = h3.str_to_int(h3.latlng_to_cell(48.137, 11.575, 9))


class FakeCluster:
    """What the queues would answer: one topic, heat maps put by the test,
    give-to-get for 'alice' only."""

    def __init__(self) -> None:
        self.maps: dict[int, heatmaps_pb2.HeatMap] = {}
        self.appended = 0
        self.calls: list[str] = []

    def put(self, start: int, congestion: float, computed_ms: int = 1) -> None:
        hm = heatmaps_pb2.HeatMap(topic="munich", window_start_ms=start,
                                  window_end_ms=start + 900_000, h3_resolution=9,
                                  computed_ms=computed_ms, source_pings=40,
                                  bbox=list(REGION.bbox))  # fmt: skip
        c = hm.cells
        c.h3.append(JAM)
        c.pings.append(40)
        c.devices.append(7)
        c.mean_speed_mps.append(1.5)
        c.free_flow_mps.append(12.0)
        c.congestion.append(congestion)
        self.maps[start] = hm

    async def call(self, method: str, raw: bytes, timeout: float | None, client: Caller) -> bytes:
        self.calls.append(method)
        if method == "GetHeatmap":
            req = client_pb2.GetHeatmapRequest.FromString(raw)
            if req.client_id != "alice":
                raise RoadlogError(Code.PERMISSION_DENIED,
                                   f"client {req.client_id!r} has not published pings")  # fmt: skip
            if not self.maps:
                raise RoadlogError(Code.NOT_FOUND, "no heat map of 'munich' for any window yet")
            windows = sorted(self.maps)
            hm = self.maps[req.window_start_ms or windows[-1]]
            return client_pb2.GetHeatmapResponse(heatmap=hm, windows=windows).SerializeToString()
        if method == "DescribeTopic":
            return self.describe().SerializeToString()
        if method == "ListTopics":
            return client_pb2.ListTopicsResponse(topics=[self.describe()]).SerializeToString()
        raise AssertionError(method)

    def describe(self) -> topics_pb2.TopicDescription:
        d = topics_pb2.TopicDescription(
            topic=topics_pb2.Topic(
                spec=topics_pb2.TopicSpec(
                    name="munich", partitions=2, region_geojson=REGION.geojson
                ),
                bbox=list(REGION.bbox),
            )
        )
        d.partitions.add(partition=0, first_offset=0, next_offset=self.appended)
        d.partitions.add(partition=1, first_offset=0, next_offset=0)
        return d

    def status(self) -> client_pb2.ClusterStatus:
        st = client_pb2.ClusterStatus(leader=2, term=5)
        for i, (role, commit, applied) in enumerate(
            [("follower", 100, 97), ("leader", 104, 104), ("follower", 104, 90)], start=1
        ):
            ns = st.nodes.add(id=i, address=f"127.0.0.1:740{i}", role=role, term=5, leader=2,
                              commit_index=commit, applied_index=applied, ready=True)  # fmt: skip
            ns.groups.add(id=0, role=role, term=5, leader=2, commit_index=commit,
                          applied_index=applied)  # fmt: skip
            # data group 1, led by node 3 in term 7 (node 2 still thinks it leads, in term 6)
            g1 = {1: ("follower", 7, 50, 41), 2: ("leader", 6, 48, 48), 3: ("leader", 7, 60, 58)}
            g_role, g_term, g_commit, g_applied = g1[i]
            ns.groups.add(id=1, role=g_role, term=g_term, leader=3, commit_index=g_commit,
                          applied_index=g_applied)  # fmt: skip
        st.queue_servers.add(grpc="127.0.0.1:7500", http="http://127.0.0.1:8080")
        return st


Run = Callable[[Callable[[TestClient[Any, Any], FakeCluster], Awaitable[None]]], None]


@pytest.fixture
def run() -> Run:
    def go(test: Callable[[TestClient[Any, Any], FakeCluster], Awaitable[None]]) -> None:
        async def main() -> None:
            fake = FakeCluster()
            api = HttpApi(fake.call, fake.status, dashboard=DashboardSettings(tile_url=""))
            async with TestClient(TestServer(api.app())) as client:
                await test(client, fake)

        asyncio.run(main())

    return go


def test_the_page_and_everything_it_loads_come_from_the_queue_server(run: Run) -> None:
    async def test(client: TestClient[Any, Any], fake: FakeCluster) -> None:
        for path in ("/", "/ui/"):
            r = await client.get(path)
            assert r.status == 200 and r.content_type == "text/html"
        page = (STATIC / "index.html").read_text()
        refs = re.findall(r'(?:src|href)="([^"]+)"', page)
        assert refs and all(ref.startswith(("/ui/static/", "data:")) for ref in refs), refs
        for ref in refs:
            if ref.startswith("/"):
                r = await client.get(ref)
                assert r.status == 200, ref
        r = await client.get("/ui", allow_redirects=False)
        assert r.status == 302 and r.headers["Location"] == "/ui/"
        r = await client.get("/ui/api/config")
        assert await r.json() == {
            "tile_url": "",
            "poll_ms": 2000,
            "client_auth": "token",
            "registration": True,
        }
        r = await client.get("/ui/static/../config.py")
        assert r.status in (403, 404)
        # no script or style from anywhere else, at run time
        for name in ("dashboard.js", "dashboard.css", "index.html"):
            text = (STATIC / name).read_text()
            loads = r"src=\"https?://|url\(\s*[\"']?https?://|fetch\(\s*[\"'`]https?://|import "
            assert not re.search(loads, text), name

    run(test)


def test_the_heat_map_is_geojson_with_the_region_and_an_etag_for_polling(run: Run) -> None:
    async def test(client: TestClient[Any, Any], fake: FakeCluster) -> None:
        q = "/ui/api/heatmap?topic=munich&client_id=alice"
        r = await client.get(q)
        assert r.status == 404 and "no heat map" in (await r.json())["error"]["reason"]
        fake.put(1_000_000, 0.9)
        r = await client.get(q)
        assert r.status == 200
        doc = await r.json()
        etag = r.headers["ETag"]
        (cell,) = doc["features"]
        assert cell["properties"]["h3"] == h3.int_to_str(JAM)
        assert cell["properties"]["congestion"] == pytest.approx(0.9)
        assert cell["properties"]["free_flow_mps"] == 12.0
        assert doc["properties"]["windows"] == [1_000_000]
        assert doc["properties"]["region"]["type"] == "Polygon"
        r = await client.get(q, headers={"If-None-Match": etag})
        assert r.status == 304  # nothing new: no body
        fake.put(1_060_000, 0.2)  # a new window
        r = await client.get(q, headers={"If-None-Match": etag})
        assert r.status == 200 and r.headers["ETag"] != etag
        doc = await r.json()
        assert doc["properties"]["window_start_ms"] == 1_060_000
        assert doc["properties"]["windows"] == [1_000_000, 1_060_000]
        old = await client.get(q + "&window_start_ms=1000000")
        assert (await old.json())["properties"]["window_start_ms"] == 1_000_000
        fake.put(1_060_000, 0.3, computed_ms=2)  # the same window computed again
        r = await client.get(q, headers={"If-None-Match": doc_etag(r)})
        assert r.status == 200

    def doc_etag(r: Any) -> str:
        return str(r.headers["ETag"])

    run(test)


def test_a_stranger_gets_the_403_and_its_reason(run: Run) -> None:
    async def test(client: TestClient[Any, Any], fake: FakeCluster) -> None:
        fake.put(1_000_000, 0.9)
        r = await client.get("/ui/api/heatmap?topic=munich&client_id=bob")
        assert r.status == 403
        body = await r.json()
        assert body["error"]["code"] == "PERMISSION_DENIED"
        assert "has not published pings" in body["error"]["reason"]
        r = await client.get("/ui/api/heatmap?client_id=alice")
        assert r.status == 400

    run(test)


def test_the_cluster_panel_shows_lag_queue_servers_and_ingest(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dashboard, "SAMPLE_EVERY_S", 0.0)

    async def test(client: TestClient[Any, Any], fake: FakeCluster) -> None:
        fake.appended = 1000
        first = await (await client.get("/ui/api/cluster")).json()
        assert [n["lag"] for n in first["nodes"]] == [7, 0, 14]  # behind the leader's commit
        assert first["nodes"][1]["role"] == "leader" and first["leader"] == 2
        assert first["queue_servers"] == [
            {"grpc": "127.0.0.1:7500", "http": "http://127.0.0.1:8080", "version": ""}
        ]
        assert first["topics"][0]["ingest_pings_per_s"] is None  # one sample: no rate yet
        fake.appended = 1500
        await asyncio.sleep(0.01)  # two samples some time apart
        second = await (await client.get("/ui/api/cluster")).json()
        (t,) = second["topics"]
        assert t["name"] == "munich" and t["pings"] == 1500 and t["ingest_pings_per_s"] > 0

    run(test)


def test_the_cluster_panel_shows_each_raft_group_with_each_replicas_lag(run: Run) -> None:
    async def test(client: TestClient[Any, Any], fake: FakeCluster) -> None:
        doc = await (await client.get("/ui/api/cluster")).json()
        g0, g1 = doc["groups"]
        assert (g0["id"], g0["leader"], g0["term"], g0["commit_index"]) == (0, 2, 5, 104)
        assert [(r["node"], r["lag"]) for r in g0["replicas"]] == [(1, 7), (2, 0), (3, 14)]
        # the leader of the highest term, its commit; lag behind it, never below 0
        assert (g1["id"], g1["leader"], g1["term"], g1["commit_index"]) == (1, 3, 7, 60)
        assert [(r["node"], r["role"], r["lag"]) for r in g1["replicas"]] == [
            (1, "follower", 19), (2, "leader", 12), (3, "leader", 2)
        ]  # fmt: skip

    run(test)


def test_the_page_draws_the_groups_table() -> None:
    page = (STATIC / "index.html").read_text()
    script = (STATIC / "dashboard.js").read_text()
    groups = page.split('<table id="groups">')[1].split("</table>")[0]
    heads = [h.split(">")[-1] for h in groups.split("</th>")[:-1]]
    assert heads == ["group", "leader", "term", "commit", "lag"]
    assert '$("groups")' in script and "r.lag" in script


def test_ingest_rates_cover_the_last_minute() -> None:
    rates = IngestRates(span_s=60)
    rates.add(0.0, {"a": 0})
    assert rates.rates() == {}
    for t in range(10, 130, 10):
        rates.add(float(t), {"a": t * 5, "b": 7})
    got = rates.rates()
    assert got["a"]["pings_per_s"] == pytest.approx(5.0) and got["a"]["over_s"] <= 70
    assert got["b"]["pings_per_s"] == 0.0


def test_leaflet_is_vendored_as_recorded() -> None:
    vendor = STATIC / "vendor" / "leaflet"
    record = json.loads((vendor / "VENDORED.json").read_text())
    for name, digest in record["sha256"].items():
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
    assert record["package"] == "leaflet" and (vendor / "LICENSE").exists()


def test_the_wheel_carries_the_static_files() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"static/**/*"' in pyproject


def test_the_page_learns_its_identity_and_whether_it_may_register_one() -> None:
    """``config`` tells the page whether it may register an identity of its
    own (open registration, with tokens on); ``identity`` who its token is,
    401 for no token or an unknown one (a token kept from another cluster)."""
    from queue_server.auth import Principal

    phone = Principal("cl-1", "cl-1", frozenset({"produce:*", "heatmap:*"}))

    async def authenticate(caller: Caller) -> Principal | None:
        if caller.credential == "Bearer rl_phone":
            return phone
        raise RoadlogError(Code.UNAUTHENTICATED, "unknown token")

    async def main() -> None:
        fake = FakeCluster()
        for settings, registration in (
            (DashboardSettings(tile_url=""), True),
            (DashboardSettings(tile_url="", registration=False), False),
            (DashboardSettings(tile_url="", client_auth="none"), False),
        ):
            api = HttpApi(fake.call, fake.status, dashboard=settings, authenticate=authenticate)
            async with TestClient(TestServer(api.app())) as client:
                got = await (await client.get("/ui/api/config")).json()
                assert got["registration"] is registration
        api = HttpApi(fake.call, fake.status, dashboard=DashboardSettings(tile_url=""),
                      authenticate=authenticate)  # fmt: skip
        async with TestClient(TestServer(api.app())) as client:
            r = await client.get("/ui/api/identity", headers={"Authorization": "Bearer rl_phone"})
            assert r.status == 200
            assert await r.json() == {
                "client_auth": "token",
                "name": "cl-1",
                "client_id": "cl-1",
                "scopes": ["heatmap:*", "produce:*"],
            }
            for headers in ({}, {"Authorization": "Bearer rl_other"}):
                r = await client.get("/ui/api/identity", headers=headers)
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "UNAUTHENTICATED"
        api = HttpApi(fake.call, fake.status, dashboard=DashboardSettings(tile_url=""))
        async with TestClient(TestServer(api.app())) as client:  # client_auth none
            r = await client.get("/ui/api/identity")
            assert await r.json() == {"client_auth": "none"}

    asyncio.run(main())
