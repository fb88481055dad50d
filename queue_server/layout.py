"""The cluster's layout as a caller may see it (issue 39, item 3): the
nodes' addresses only for an identity with ``admin`` or ``ops``; any other
identity sees each node's id, role, terms and indexes (and the queue
servers, the front door it already reached), never where a node listens.
The same for gRPC ``Status``, HTTP ``GET /v1/cluster`` and the dashboard's
cluster panel; with client_auth none (no identities) everyone sees all."""

from __future__ import annotations

from queue_server.auth import Principal
from roadlog.scopes import sees_addresses
from roadlog.v1 import client_pb2


def layout_for(
    st: client_pb2.ClusterStatus, principal: Principal | None
) -> client_pb2.ClusterStatus:
    """``st`` as ``principal`` may see it (None: client_auth none, all of it)."""
    if principal is None or sees_addresses(principal.scopes):
        return st
    out = client_pb2.ClusterStatus()
    out.CopyFrom(st)
    for n in out.nodes:
        n.address = ""
    return out
