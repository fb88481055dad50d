"""The HTTP read of a partition (issue 41): one that names no fence first
learns its topic's fences at the groups' leaders (ReadFences) and reads
fenced on them; one that names them reads on them as given; either answer
says what it reflects (JSON and the X-Roadlog-Group-Fences header, in the
form ?group_fences= takes back), never less than it was given."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from queue_server.auth import Caller
from queue_server.http_api import HttpApi
from roadlog.v1 import client_pb2

pytestmark = pytest.mark.unit


class Fake:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def call(self, method: str, raw: bytes, timeout: float | None, who: Caller) -> bytes:
        if method == "ReadFences":
            self.calls.append((method, client_pb2.ReadFencesRequest.FromString(raw).topic))
            r = client_pb2.ReadFencesResponse(applied_index=0)
            r.group_fences.add(group=2, applied_index=500)
            return r.SerializeToString()
        if method == "Fetch":
            req = client_pb2.FetchRequest.FromString(raw)
            self.calls.append((method, [(f.group, f.applied_index) for f in req.group_fences]))
            resp = client_pb2.FetchResponse(next_offset=0, end_offset=0, served_by="3")
            resp.group_fences.add(group=2, applied_index=480)  # an older replica: the fence wins
            return resp.SerializeToString()
        raise AssertionError(method)


def run(body: Any) -> None:
    fake = Fake()

    async def main() -> None:
        api = HttpApi(fake.call, lambda: client_pb2.ClusterStatus(leader=1))
        async with TestClient(TestServer(api.app())) as client:
            await body(client, fake)

    asyncio.run(main())


def test_a_read_that_names_no_fence_learns_them_first_and_says_what_it_reflects() -> None:
    async def body(client: TestClient[Any, Any], fake: Fake) -> None:
        resp = await client.get("/v1/topics/porto/partitions/3/pings")
        assert resp.status == 200, await resp.text()
        got = await resp.json()
        assert fake.calls == [("ReadFences", "porto"), ("Fetch", [(2, 500)])]
        assert got["group_fences"] == {"2": 500}
        assert resp.headers["X-Roadlog-Group-Fences"] == "2:500"
        # Passed back, they are used as they are: no second ReadFences.
        fake.calls.clear()
        again = await client.get(
            "/v1/topics/porto/partitions/3/pings?group_fences="
            + resp.headers["X-Roadlog-Group-Fences"]
        )
        assert again.status == 200
        assert fake.calls == [("Fetch", [(2, 500)])]

    run(body)


def test_the_fences_of_a_topic_are_one_get_away() -> None:
    async def body(client: TestClient[Any, Any], fake: Fake) -> None:
        resp = await client.get("/v1/topics/porto/fences")
        assert resp.status == 200
        assert await resp.json() == {"group_fences": {"2": 500}, "applied_index": 0}
        assert resp.headers["X-Roadlog-Group-Fences"] == "2:500"

    run(body)
