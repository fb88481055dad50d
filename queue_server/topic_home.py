"""A member cluster's answer about a topic it does not hold (issue 43,
docs/federation.md): the topic's home, from the directory.

``TopicHomes`` keeps the homes of the federation's topics that live in
other members (refreshed from the directory by ``MemberAgent``), and is
asked only where a node refused a request because it knows no such topic:
a NOT_FOUND call, or a PublishBatch answer holding the node's "no topic"
refusal (a byte search of the answer, then parsing only on a hit). So a
topic held here costs nothing more. A topic not in the cache is looked up
in the directory once (an answer "none", or no answer, is kept
``MISS_TTL_S``): a directory that is down costs a refusal at most one
lookup's timeout, then none, and stops nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from google.protobuf.message import Message

from queue_server.auth import topics_of
from roadlog.errors import Code, RoadlogError
from roadlog.federation.home import Home, TopicElsewhere, home_of
from roadlog.v1 import client_pb2, federation_pb2

log = logging.getLogger("roadlog.queue.federation")
MISS_TTL_S = 5.0
LOOKUP_TIMEOUT_S = 2.0
NO_TOPIC = b"no topic "  # the node's refusal of a topic it does not hold (state/topics.py)
# Requests that name their topic as ``name`` (the rest: the rpc table's topic_field).
_BY_NAME: dict[str, type[Message]] = {
    "DescribeTopic": client_pb2.DescribeTopicRequest,
    "DeleteTopic": client_pb2.DeleteTopicRequest,
    "UpdateTopic": client_pb2.UpdateTopicRequest,
}
Lookup = Callable[[str, float], Awaitable[federation_pb2.TopicHome | None]]


def topic_named(method: str, request: bytes) -> str | None:
    """The one topic a request names (None: none, or several)."""
    cls = _BY_NAME.get(method)
    if cls is not None:
        try:
            return str(cls.FromString(request).name)  # type: ignore[attr-defined]
        except Exception:
            return None
    found = topics_of(method, request)
    return found[0] if found and len(set(found)) == 1 else None


class TopicHomes:
    """Topics whose home is another member, and the lookup of one missed."""

    def __init__(self, own: str, lookup: Lookup | None = None) -> None:
        self.own = own  # this member's name: a topic homed here is never sent away
        self.lookup = lookup
        self.homes: dict[str, Home] = {}
        self._misses: dict[str, float] = {}
        self.redirects = 0  # answers that named another home (a figure for tests and logs)

    def refresh(self, fed: federation_pb2.Federation) -> None:
        """The federation as the directory told it: every topic of another member."""
        members = {m.name: m for m in fed.members}
        homes: dict[str, Home] = {}
        for t in fed.topics:
            m = members.get(t.cluster)
            if m is not None and t.cluster != self.own:
                homes[t.topic] = home_of(m.name, m.queue_servers, m.http)
        self.homes = homes

    async def elsewhere(self, topic: str) -> Home | None:
        """The topic's home if it is another member (None: here, unknown, or
        the directory could not say in time)."""
        home = self.homes.get(topic)
        if home is not None or self.lookup is None:
            return home
        now = time.monotonic()
        if now - self._misses.get(topic, -MISS_TTL_S) < MISS_TTL_S:
            return None
        try:
            found = await self.lookup(topic, LOOKUP_TIMEOUT_S)
        except RoadlogError as e:
            log.info("directory lookup failed", extra={"topic": topic, "why": e.message})
            found = None
        if found is None or found.cluster == self.own or not found.queue_servers:
            if len(self._misses) > 10_000:
                self._misses.clear()
            self._misses[topic] = now
            return None
        home = self.homes[topic] = home_of(found.cluster, found.queue_servers, found.http)
        return home

    async def check(self, method: str, request: bytes, e: RoadlogError) -> None:
        """Raise ``TopicElsewhere`` in place of the node's NOT_FOUND for a
        topic homed in another member; return if it is not that."""
        if e.code != Code.NOT_FOUND or not e.message.startswith(NO_TOPIC.decode()):
            return
        topic = topic_named(method, request)
        home = await self.elsewhere(topic) if topic else None
        if topic and home is not None:
            self.redirects += 1
            raise TopicElsewhere(topic, home) from None

    async def redirect_results(self, request: bytes, answer: bytes) -> bytes:
        """A PublishBatch answer with each "no topic" refusal of a topic
        homed elsewhere turned into ``TopicElsewhere``'s (its home at the
        end of the message: streams and the publish link carry no metadata)."""
        resp = client_pb2.PublishBatchResponseView.FromString(answer)
        try:
            requests = client_pb2.PublishBatchRequestView.FromString(request).requests
        except Exception:
            return answer
        changed = False
        for raw, r in zip(requests, resp.results, strict=False):
            if r.code != Code.NOT_FOUND or not r.message.startswith(NO_TOPIC.decode()):
                continue
            topic = client_pb2.PublishRequestView.FromString(raw).topic
            home = await self.elsewhere(topic)
            if home is not None:
                moved = TopicElsewhere(topic, home)
                r.code, r.message = int(moved.code), moved.message
                changed = True
                self.redirects += 1
        return resp.SerializeToString() if changed else answer
