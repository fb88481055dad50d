"""What the HTTP API tells browsers and believes of callers (issue 39,
finding 6): every answer (the page, its files, the API, errors, redirects)
carries CSP, X-Content-Type-Options, Referrer-Policy and X-Frame-Options,
with the street map's tile origin the only other place images may come
from; and a publish with a token needs no client_id (the token's identity
publishes, whatever the body says)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from queue_server.auth import Caller, Principal
from queue_server.dashboard import DashboardSettings
from queue_server.http_api import HttpApi, content_security_policy
from roadlog.v1 import client_pb2, topics_pb2

pytestmark = pytest.mark.unit

ALICE = Principal("cl-alice", "alice", frozenset({"produce:*"}))


class Fake:
    def __init__(self) -> None:
        self.published: list[str] = []

    async def call(self, method: str, raw: bytes, timeout: float | None, who: Caller) -> bytes:
        if method == "DescribeTopic":
            return topics_pb2.TopicDescription().SerializeToString()
        if method == "Publish":
            self.published.append(client_pb2.PublishRequest.FromString(raw).client_id)
            off = client_pb2.PartitionOffsets(partition=0, base_offset=0, count=1)
            return client_pb2.PublishResponse(offsets=[off]).SerializeToString()
        raise AssertionError(method)

    async def authenticate(self, caller: Caller) -> Principal | None:
        return ALICE if caller.credential == "Bearer good" else None


def with_client(
    body: Callable[[TestClient[Any, Any], Fake], Awaitable[None]], tile_url: str = ""
) -> None:
    fake = Fake()

    async def main() -> None:
        api = HttpApi(
            fake.call,
            lambda: client_pb2.ClusterStatus(leader=1),
            dashboard=DashboardSettings(tile_url=tile_url),
            authenticate=fake.authenticate,
        )
        async with TestClient(TestServer(api.app())) as client:
            await body(client, fake)

    asyncio.run(main())


SECURITY_HEADERS = ("Content-Security-Policy", "X-Content-Type-Options", "Referrer-Policy")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/ui/"),  # the page
        ("GET", "/ui/static/dashboard.js"),  # its files
        ("GET", "/openapi.json"),  # the API
        ("GET", "/v1/no/such/path"),  # an error
        ("GET", "/ui"),  # a redirect
        ("GET", "/v1/topics"),  # refused: no token
    ],
)
def test_every_answer_carries_the_security_headers(method: str, path: str) -> None:
    async def body(client: TestClient[Any, Any], fake: Fake) -> None:
        resp = await client.request(method, path, allow_redirects=False)
        missing = [h for h in SECURITY_HEADERS if h not in resp.headers]
        assert not missing, (resp.status, missing)
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert resp.headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]

    with_client(body)


def test_the_csp_lets_images_come_from_the_tile_server_only() -> None:
    csp = content_security_policy("https://{s}.tile.example.org/{z}/{x}/{y}.png")
    img = next(d for d in csp.split("; ") if d.startswith("img-src"))
    assert img == "img-src 'self' data: blob: https://*.tile.example.org"
    assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp
    plain = content_security_policy("")
    assert "img-src 'self' data: blob:;" in plain + ";"


def test_a_publish_with_a_token_needs_no_client_id_and_publishes_as_the_token() -> None:
    ping = {"device_id": "d", "ts_ms": 1_700_000_000_000, "lat": 48.1, "lon": 11.5}

    async def body(client: TestClient[Any, Any], fake: Fake) -> None:
        auth = {"Authorization": "Bearer good"}
        for sent in ({"pings": [ping]}, {"client_id": "someone-else", "pings": [ping]}):
            resp = await client.post("/v1/topics/munich/pings", json=sent, headers=auth)
            assert resp.status == 200, await resp.text()
        assert fake.published == ["cl-alice", "someone-else"]  # (the nodes store the token's)
        # Without identities (the gate names nobody) the body must say who publishes.
        anonymous = await client.post("/v1/topics/munich/pings", json={"pings": [ping]})
        assert anonymous.status == 400 and "client_id" in await anonymous.text()

    with_client(body)


def test_the_openapi_document_needs_no_client_id_in_a_publish() -> None:
    from queue_server.openapi import OPENAPI

    text = json.dumps(OPENAPI)
    assert '"required": ["pings"]' in text
