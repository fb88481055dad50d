"""A node process's gRPC server: the cluster's auth interceptors and the
limits every node port shares (the main process's and each worker
process's)."""

from __future__ import annotations

from typing import Any

import grpc

from node_daemon.process.admin import NODE_CHANGES, NODE_PROTECTED, node_callers, refused_by_cert
from roadlog.limits import PEER_MESSAGE_BYTES
from roadlog.runtime import tls
from roadlog.runtime.auth import ClusterAuth


def _is_node(context: Any) -> bool:
    """The caller holds a node's certificate of the cluster's CA."""
    ident = tls.grpc_identity(context)
    return ident is not None and ident.kind == "node"


def node_grpc_server(token: str) -> grpc.aio.Server:
    """An unstarted server: without TLS the cluster token guards what it
    guards; with TLS the caller's certificate decides who may call what."""
    interceptors: list[grpc.aio.ServerInterceptor] = [ClusterAuth(token, NODE_PROTECTED)]
    if not tls.current().insecure:
        interceptors = [
            tls.CertAuth(node_callers, refused_by_cert),
            ClusterAuth(token, NODE_CHANGES, exempt=_is_node),
        ]
    return grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", PEER_MESSAGE_BYTES),
            ("grpc.max_send_message_length", PEER_MESSAGE_BYTES),
            # Peers ping every 2 s to notice a dead node early: allow it.
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ("grpc.keepalive_permit_without_calls", 1),
            # A port another process holds is refused, never shared: with
            # SO_REUSEPORT two nodes' processes on one host (a worker's fixed
            # port taken) would split each other's peers' connections.
            ("grpc.so_reuseport", 0),
        ],
    )
