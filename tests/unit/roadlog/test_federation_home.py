"""A topic's home as a redirect names it (issue 43): the header's text,
the same at the end of a publish's refusal; a connection and a publisher
that follow one drop the old cluster's fences."""

from __future__ import annotations

import asyncio

import pytest

from roadlog.client import Connection
from roadlog.client_tls import ClientTLS
from roadlog.errors import Code
from roadlog.federation.home import (
    HOME_HEADER,
    Home,
    TopicElsewhere,
    home_in_message,
    home_in_metadata,
    parse_home,
)
from roadlog.publisher import Publisher

pytestmark = pytest.mark.unit
INSECURE = ClientTLS(insecure=True)


def test_the_header_names_the_cluster_and_its_queue_servers() -> None:
    home = Home("us", ("10.0.1.1:7500", "10.0.1.2:7500"))
    assert home.header == "us=10.0.1.1:7500,10.0.1.2:7500"
    assert parse_home(home.header) == home
    for bad in ("", "us", "us=", "=10.0.1.1:7500"):
        assert parse_home(bad) is None, bad
    assert home_in_metadata([("x", "y"), (HOME_HEADER, home.header.encode())]) == home
    assert home_in_metadata([("x", "y")]) is None


def test_a_refusal_carries_the_home_at_the_end_of_its_message() -> None:
    e = TopicElsewhere("denver", Home("us", ("10.0.1.1:7500",), ("https://10.0.1.1:8080",)))
    assert e.code == Code.FAILED_PRECONDITION and "'us'" in e.message
    assert home_in_message(e.message) == Home("us", ("10.0.1.1:7500",))
    assert home_in_message("no topic 'denver'") is None
    assert home_in_message(f"[{HOME_HEADER}: us=a:1] and more") is None  # only at the end


def test_a_connection_that_follows_drops_its_fences() -> None:
    conn = Connection(["127.0.0.1:1"], tls=INSECURE)  # channels connect lazily: never called
    try:
        conn.raise_fence(900)
        conn.raise_group_fence(2, 400)
        conn.follow(Home("us", ("127.0.0.1:2", "127.0.0.1:3")))
        assert (conn.fence, conn.group_fences) == (0, {})
        assert (conn.cluster, conn.servers, len(conn.channels)) == (
            "us",
            ["127.0.0.1:2", "127.0.0.1:3"],
            2,
        )
        conn.raise_fence(7)
        conn.follow(Home("us", ("127.0.0.1:2", "127.0.0.1:3")))  # already there: nothing changes
        assert conn.fence == 7
    finally:
        conn.close()


def test_a_publisher_that_follows_drops_its_fences_and_keeps_the_old_streams_to_close() -> None:
    async def run() -> None:
        pub = Publisher(["127.0.0.1:1"], tls=INSECURE)
        pub._open()
        pub.fence, pub.group_fences = 900, {2: 400}
        pub.follow(Home("us", ("127.0.0.1:2",)))
        assert (pub.fence, pub.group_fences, pub.cluster, pub.servers) == (
            0,
            {},
            "us",
            ["127.0.0.1:2"],
        )
        assert len(pub._retired) == 1 and len(pub._calls) == 1
        await pub.close()
        assert pub._retired == [] and pub._calls == []

    asyncio.run(run())
