"""A topic's home as a member cluster names it when asked about a topic it
does not hold (issue 43): gRPC FAILED_PRECONDITION with the trailing
metadata ``roadlog-topic-home``; HTTP 307 with ``Location`` and the same
header; a publish's own result (over a stream or the publish link, which
carry no metadata) the same code with the header's text at the end of its
message, ``[roadlog-topic-home: VALUE]``.

VALUE is ``CLUSTER=HOST:PORT,HOST:PORT``: the home's name and its queue
servers' gRPC addresses.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from roadlog.errors import Code, RoadlogError

HOME_HEADER = "roadlog-topic-home"
_IN_MESSAGE = re.compile(r"\[" + HOME_HEADER + r": ([^\]]+)\]$")


@dataclass(frozen=True, slots=True)
class Home:
    """A member cluster holding a topic, and where its queue servers are."""

    cluster: str
    queue_servers: tuple[str, ...]
    http: tuple[str, ...] = ()

    @property
    def header(self) -> str:
        """The ``roadlog-topic-home`` value."""
        return f"{self.cluster}={','.join(self.queue_servers)}"


def parse_home(value: str) -> Home | None:
    """A ``roadlog-topic-home`` value's home (None: not one)."""
    cluster, eq, servers = value.strip().partition("=")
    found = tuple(s for s in servers.split(",") if s)
    return Home(cluster, found) if eq and cluster and found else None


def home_in_message(message: str) -> Home | None:
    """The home a refusal's message ends with, if any."""
    m = _IN_MESSAGE.search(message or "")
    return parse_home(m.group(1)) if m else None


def home_in_metadata(metadata: Iterable[Any] | None) -> Home | None:
    """The home a call's trailing metadata names, if any (pairs of key and
    value, as gRPC gives them)."""
    for key, value in metadata or ():
        if key == HOME_HEADER:
            return parse_home(value.decode() if isinstance(value, bytes) else value)
    return None


class TopicElsewhere(RoadlogError):
    """The topic lives in another member cluster, ``home``: ask there."""

    def __init__(self, topic: str, home: Home) -> None:
        super().__init__(
            Code.FAILED_PRECONDITION,
            f"topic {topic!r} has its home in cluster {home.cluster!r}: ask its queue servers "
            f"[{HOME_HEADER}: {home.header}]",
        )
        self.topic = topic
        self.home = home


def home_of(cluster: str, queue_servers: Sequence[str], http: Sequence[str] = ()) -> Home:
    return Home(cluster, tuple(queue_servers), tuple(http))
