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
import inspect
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


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries ``token`` (none for "": a caller
    that proves itself by its certificate alone)."""
    return ((AUTH_KEY, token),) if token else ()


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
    counted in roadlog_auth_refused_total by method). ``exempt(context)``:
    a caller that needs no token (with TLS: a node, by its certificate), so
    the token is no peer credential, only an operator's for changes."""

    def __init__(
        self,
        token: str,
        protected: Callable[[str], bool],
        exempt: Callable[[Any], bool] | None = None,
    ) -> None:
        self.token = token
        self.protected = protected
        self.exempt = exempt

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
        if self.exempt is not None:
            exempt = self.exempt

            async def check(context: Any) -> None:
                if not exempt(context):
                    REFUSED_CALLS.labels(method).inc()
                    await _refuse(context)

            return guarded(handler, check)
        REFUSED_CALLS.labels(method).inc()
        return _refusing(handler)


async def _refuse(context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


def _refusing(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""
    return guarded(handler, _refuse)


def guarded(
    handler: grpc.RpcMethodHandler[Any, Any], check: Callable[[Any], Awaitable[None]]
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` (of any of the four kinds) behind ``check(context)``,
    awaited before it runs; a check that aborts the call refuses it."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        inner_ss: Any = handler.stream_stream

        async def ss(it: Any, context: Any) -> Any:
            await check(context)
            async for r in inner_ss(it, context):
                yield r

        # a servicer's stream-stream method may be an async generator or a coroutine
        if _is_asyncgen(inner_ss):
            return grpc.stream_stream_rpc_method_handler(ss, **kw)

        async def ss_co(it: Any, context: Any) -> Any:
            await check(context)
            return await inner_ss(it, context)

        return grpc.stream_stream_rpc_method_handler(ss_co, **kw)
    if handler.request_streaming:
        inner_su: Any = handler.stream_unary

        async def su(it: Any, context: Any) -> Any:
            await check(context)
            return await inner_su(it, context)

        return grpc.stream_unary_rpc_method_handler(su, **kw)
    if handler.response_streaming:
        inner_us: Any = handler.unary_stream
        if _is_asyncgen(inner_us):

            async def us(req: Any, context: Any) -> Any:
                await check(context)
                async for r in inner_us(req, context):
                    yield r

            return grpc.unary_stream_rpc_method_handler(us, **kw)

        async def us_co(req: Any, context: Any) -> Any:
            await check(context)
            return await inner_us(req, context)

        return grpc.unary_stream_rpc_method_handler(us_co, **kw)
    inner_uu: Any = handler.unary_unary

    async def uu(req: Any, context: Any) -> Any:
        await check(context)
        return await inner_uu(req, context)

    return grpc.unary_unary_rpc_method_handler(uu, **kw)


def _is_asyncgen(fn: Any) -> bool:
    return inspect.isasyncgenfunction(fn)
