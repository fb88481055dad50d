"""Cluster authentication between roadlog's own processes (nodes, queue
servers, Spark tasks): a token derived from the cluster secret, carried in
gRPC metadata, checked by one server interceptor.

Invariant: a call to a protected method without the cluster's token never
reaches its handler; it is answered UNAUTHENTICATED. Client-facing methods
are not protected here.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import grpc
from prometheus_client import Counter

AUTH_KEY = "x-roadlog-auth"
REFUSED = "bad cluster credentials"
REFUSED_CALLS = Counter(
    "roadlog_auth_refused_total", "calls refused for want of the cluster token", ["method"]
)


def cluster_token(secret: bytes, cluster: str) -> str:
    """The token the processes of one cluster present to each other."""
    return hmac.new(secret, cluster.encode(), hashlib.sha256).hexdigest()


def token_metadata(token: str) -> tuple[tuple[str, str]]:
    """The gRPC metadata that carries ``token``."""
    return ((AUTH_KEY, token),)


def carries_token(metadata: Sequence[tuple[str, Any]] | None, token: str) -> bool:
    """Does this call's metadata carry ``token``? (constant time)"""
    given = next((str(v) for k, v in metadata or () if k == AUTH_KEY), "")
    return hmac.compare_digest(given, token)


def protects(services: Collection[str], methods: Collection[str] = ()) -> Callable[[str], bool]:
    """Which calls need the token: every method of ``services`` (full names,
    "roadlog.v1.RaftPeer") and each of ``methods`` ("/roadlog.v1.Admin/Leave")."""
    prefixes = tuple(f"/{s}/" for s in services)
    exact = frozenset(methods)
    return lambda method: method in exact or method.startswith(prefixes)


class ClusterAuth(grpc.aio.ServerInterceptor):
    """Refuses protected calls that do not carry the cluster token (each
    counted in roadlog_auth_refused_total by method)."""

    def __init__(self, token: str, protected: Callable[[str], bool]) -> None:
        self.token = token
        self.protected = protected

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or not self.protected(method):
            return handler
        if carries_token(details.invocation_metadata, self.token):
            return handler
        REFUSED_CALLS.labels(method).inc()
        return _refusing(handler)


async def _refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


def _refusing(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(_refuse, **kw)
