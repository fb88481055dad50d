"""What give-to-get counts as a contribution to a topic (issue 39, item 3),
as its spec says: at least ``contribution_min_pings`` pings over at least
``contribution_min_seconds``, the last within the contribution window. A
topic from before these fields has the defaults. Shared by the node (which
applies the rule), the queue server and the tools (which show it)."""

from __future__ import annotations

from roadlog.v1 import topics_pb2

DEFAULT_CONTRIBUTION_MIN_PINGS = 20
DEFAULT_CONTRIBUTION_MIN_SECONDS = 60


def min_pings(spec: topics_pb2.TopicSpec) -> int:
    """The pings a contribution to the topic needs (the default if unset)."""
    if spec.HasField("contribution_min_pings"):
        return spec.contribution_min_pings
    return DEFAULT_CONTRIBUTION_MIN_PINGS


def min_seconds(spec: topics_pb2.TopicSpec) -> int:
    """The seconds a contribution to the topic must span (the default if unset)."""
    if spec.HasField("contribution_min_seconds"):
        return spec.contribution_min_seconds
    return DEFAULT_CONTRIBUTION_MIN_SECONDS
