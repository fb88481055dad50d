"""A member's queue server names a topic's home only where a node refused
a topic it does not hold, and asks the directory at most once a while for
one it does not know (issue 43)."""

from __future__ import annotations

import asyncio

import pytest

from queue_server.topic_home import MISS_TTL_S, TopicHomes, topic_named
from roadlog.errors import Code, RoadlogError
from roadlog.federation.home import TopicElsewhere, home_in_message
from roadlog.v1 import client_pb2, federation_pb2

pytestmark = pytest.mark.unit


def federation() -> federation_pb2.Federation:
    fed = federation_pb2.Federation()
    fed.members.add(name="eu", queue_servers=["10.0.0.1:7500"])
    fed.members.add(name="us", queue_servers=["10.0.1.1:7500"], http=["https://10.0.1.1:8080"])
    fed.topics.add(topic="paris", cluster="eu")
    fed.topics.add(topic="denver", cluster="us")
    return fed


def test_only_other_members_topics_are_kept() -> None:
    homes = TopicHomes("eu")
    homes.refresh(federation())
    assert set(homes.homes) == {"denver"}
    assert homes.homes["denver"].http == ("https://10.0.1.1:8080",)


def test_a_not_found_of_a_topic_homed_elsewhere_becomes_the_redirect() -> None:
    homes = TopicHomes("eu")
    homes.refresh(federation())
    req = client_pb2.DescribeTopicRequest(name="denver").SerializeToString()

    async def check(e: RoadlogError, name: str = "denver") -> None:
        r = client_pb2.DescribeTopicRequest(name=name).SerializeToString()
        await homes.check("DescribeTopic", r, e)

    with pytest.raises(TopicElsewhere) as moved:
        asyncio.run(check(RoadlogError(Code.NOT_FOUND, "no topic 'denver'")))
    assert moved.value.home.cluster == "us"
    # Anything else passes as it was: another code, another refusal, a topic not known.
    asyncio.run(check(RoadlogError(Code.UNAVAILABLE, "no leader")))
    asyncio.run(check(RoadlogError(Code.NOT_FOUND, "no group 'g'")))
    asyncio.run(check(RoadlogError(Code.NOT_FOUND, "no topic 'atlantis'"), "atlantis"))
    assert topic_named("DescribeTopic", req) == "denver"
    fetch = client_pb2.FetchRequest(topic="denver").SerializeToString()
    assert topic_named("Fetch", fetch) == "denver"


def test_a_publish_batchs_refusals_name_the_home_each_and_the_rest_is_kept() -> None:
    homes = TopicHomes("eu")
    homes.refresh(federation())
    request = client_pb2.PublishBatchRequestView(
        requests=[
            client_pb2.PublishRequestView(topic="paris").SerializeToString(),
            client_pb2.PublishRequestView(topic="denver").SerializeToString(),
        ]
    ).SerializeToString()
    answer = client_pb2.PublishBatchResponse()
    answer.results.add(code=0)
    answer.results.add(code=int(Code.NOT_FOUND), message="no topic 'denver'")
    out = client_pb2.PublishBatchResponse.FromString(
        asyncio.run(homes.redirect_results(request, answer.SerializeToString()))
    )
    assert out.results[0].code == 0
    assert out.results[1].code == Code.FAILED_PRECONDITION
    home = home_in_message(out.results[1].message)
    assert home is not None and home.cluster == "us"


def test_a_topic_not_known_is_asked_once_while_its_miss_is_fresh() -> None:
    asked: list[str] = []

    async def lookup(topic: str, timeout: float) -> federation_pb2.TopicHome | None:
        asked.append(topic)
        if topic == "lima":
            return federation_pb2.TopicHome(topic=topic, cluster="sa", queue_servers=["x:1"])
        if topic == "down":
            raise RoadlogError(Code.UNAVAILABLE, "the directory did not answer")
        return None

    homes = TopicHomes("eu", lookup)

    async def run() -> None:
        assert (await homes.elsewhere("lima")) is not None
        assert (await homes.elsewhere("lima")) is not None  # cached: not asked again
        for _ in range(3):
            assert (await homes.elsewhere("atlantis")) is None
            assert (await homes.elsewhere("down")) is None

    asyncio.run(run())
    assert asked == ["lima", "atlantis", "down"]
    assert MISS_TTL_S > 0
