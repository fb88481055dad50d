"""Topics closed to open produce (issue 39, item 3): a self-registered
identity's ``produce:*`` does not cover a topic whose spec says
``no_open_produce``; only ``produce:TOPIC`` by name or ``admin`` do.

Why on the node: the queue server knows the caller's scopes but not the
topic's spec, which is group 0's. It says the identity registered itself
and sends its scopes with the work item (``WorkItem.registered``,
``WorkItem.scopes``); the leader that validates the publish reads the
topic from its replica of group 0 (a data group's placed copy of the topic
keeps the spec it was placed with, so it is never asked) and refuses the
publish PERMISSION_DENIED before it is validated or proposed. An update
that closes a topic holds for a data group's publishes once that node's
replica of group 0 applied it. An item that does not say ``registered`` (an
admin-made identity, client_auth none, a queue server from before the
field) is not checked.
"""

from __future__ import annotations

from collections.abc import Iterable

from roadlog.errors import Code, RoadlogError
from roadlog.scopes import open_produce_covers
from roadlog.v1 import topics_pb2


def closed_to(topic: topics_pb2.Topic, scopes: Iterable[str]) -> RoadlogError | None:
    """Why a self-registered identity with ``scopes`` may not publish to
    ``topic`` (None: it may)."""
    name = topic.spec.name
    if not topic.spec.no_open_produce or open_produce_covers(scopes, name):
        return None
    return RoadlogError(
        Code.PERMISSION_DENIED,
        f"topic {name!r} is closed to self-registered identities (no open produce): "
        f"their produce:* does not cover it; ask an operator for a token with produce:{name}",
    )
