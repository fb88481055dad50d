"""The directory's client (issue 43, docs/federation.md): a topic's home
looked up once and cached, topics placed, the federation listed; and a
``Connection`` to each member cluster, made once.

Invariant: a topic's cached home is only replaced by a redirect or a new
lookup (``forget``), never dropped on an error of its home; so a client
that knows a topic's home keeps publishing and reading there while the
directory is down (the directory is asked only for what is not cached).
In this first slice every member trusts the same CA and accepts the same
admin token as the directory (one root, copied at founding): the client's
``tls`` reaches them all.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from roadlog.client import Connection
from roadlog.client_tls import ClientTLS
from roadlog.federation.home import Home, home_of
from roadlog.v1 import federation_pb2


class Directory:
    """The directory's queue servers, and the members it names."""

    def __init__(
        self, servers: Sequence[str], tls: ClientTLS | None = None, timeout: float = 30.0
    ) -> None:
        self.tls = tls if tls is not None else ClientTLS.from_env()
        self.timeout = timeout
        self.conn = Connection(servers, timeout=timeout, tls=self.tls)
        self._homes: dict[str, Home] = {}
        self._members: dict[str, Connection] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self.conn.close()
        for c in self._members.values():
            c.close()

    def __enter__(self) -> Directory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ asking

    def lookup(self, topic: str) -> Home:
        """The topic's home: cached, else asked once (NOT_FOUND: none)."""
        with self._lock:
            home = self._homes.get(topic)
        if home is not None:
            return home
        found = self.conn.call("LookupTopic", federation_pb2.LookupTopicRequest(topic=topic))
        return self.learn(topic, home_of(found.cluster, found.queue_servers, found.http))

    def learn(self, topic: str, home: Home) -> Home:
        """Cache ``home`` as the topic's (a lookup's, a placement's or a redirect's)."""
        with self._lock:
            self._homes[topic] = home
        return home

    def forget(self, topic: str) -> None:
        """Drop the cached home (the next ``lookup`` asks the directory)."""
        with self._lock:
            self._homes.pop(topic, None)

    def place(self, topic: str, on: str = "", tags: Sequence[str] = ()) -> Home:
        """Give the topic its home (``PlaceTopicRequest``'s rule)."""
        req = federation_pb2.PlaceTopicRequest(topic=topic, on=on, tags=list(tags))
        found = self.conn.call("PlaceTopic", req)
        return self.learn(topic, home_of(found.cluster, found.queue_servers, found.http))

    def forget_home(self, topic: str, cluster: str = "") -> bool:
        """Give the topic's home up in the directory (its creation failed)."""
        self.forget(topic)
        req = federation_pb2.ForgetTopicHomeRequest(topic=topic, cluster=cluster)
        return bool(self.conn.call("ForgetTopicHome", req).forgotten)

    def federation(self) -> federation_pb2.Federation:
        fed = self.conn.call("GetFederation", federation_pb2.GetFederationRequest())
        assert isinstance(fed, federation_pb2.Federation)
        return fed

    # ------------------------------------------------------------ members

    def member(self, home: Home) -> Connection:
        """A connection to the member cluster ``home`` names (one a member)."""
        with self._lock:
            conn = self._members.get(home.cluster)
            if conn is None:
                conn = Connection(home.queue_servers, timeout=self.timeout, tls=self.tls)
                conn.cluster = home.cluster
                self._members[home.cluster] = conn
            return conn

    def member_by_name(self, name: str, queue_servers: Sequence[str]) -> Connection:
        return self.member(home_of(name, queue_servers))

    def connection(self, topic: str) -> Connection:
        """A connection to the topic's home."""
        return self.member(self.lookup(topic))
