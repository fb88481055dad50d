"""A member's load report (issue 43): pings a second from the offsets its
cluster's topics reached (every page of one ListTopics a report), 0 until
two reports are known or when the cluster cannot say."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from queue_server.config import QueueConfig
from queue_server.member_agent import MemberAgent
from queue_server.topic_home import TopicHomes
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, topics_pb2

pytestmark = pytest.mark.unit


def page(offsets: list[int], token: str = "") -> bytes:
    d = topics_pb2.TopicDescription()
    for p, n in enumerate(offsets):
        d.partitions.add(partition=p, next_offset=n)
    return client_pb2.ListTopicsResponse(topics=[d], next_page_token=token).SerializeToString()


class Cluster:
    """Two pages of topics; ``grow`` pings more at the next read."""

    def __init__(self) -> None:
        self.stored = 100
        self.down = False
        self.asked: list[str] = []

    async def call(self, method: str, request: bytes, timeout: float | None) -> bytes:
        assert method == "ListTopics"
        if self.down:
            raise RoadlogError(Code.UNAVAILABLE, "no leader")
        token = client_pb2.ListTopicsRequest.FromString(request).page_token
        self.asked.append(token)
        return page([self.stored, 50], "p2") if not token else page([7])


def test_pings_a_second_come_from_the_offsets_between_two_reports() -> None:
    cluster = Cluster()
    agent = MemberAgent(QueueConfig(), TopicHomes("eu"), None, cluster.call)  # type: ignore[arg-type]

    async def run() -> list[float]:
        out = [await agent.pings_per_s(1.0)]
        assert cluster.asked == ["", "p2"]  # every page
        cluster.stored += 1000
        await asyncio.sleep(0.2)
        out.append(await agent.pings_per_s(1.0))
        cluster.down = True
        out.append(await agent.pings_per_s(1.0))
        return out

    first, second, down = asyncio.run(run())
    assert first == 0.0 and down == 0.0
    assert 1000 / 1.0 < second <= 1000 / 0.2


def test_without_its_cluster_the_figure_is_zero() -> None:
    agent: Any = MemberAgent(QueueConfig(), TopicHomes("eu"), None)  # type: ignore[arg-type]
    assert asyncio.run(agent.pings_per_s(1.0)) == 0.0
