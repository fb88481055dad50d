"""Cluster authentication: the token, and the one interceptor that keeps
protected methods from anyone without it."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from roadlog.runtime.auth import (
    AUTH_KEY,
    REFUSED,
    ClusterAuth,
    carries_token,
    cluster_token,
    protects,
    token_metadata,
)

pytestmark = pytest.mark.unit


def test_the_token_depends_on_secret_and_cluster() -> None:
    assert cluster_token(b"a", "c1") != cluster_token(b"b", "c1")
    assert cluster_token(b"a", "c1") != cluster_token(b"a", "c2")
    assert cluster_token(b"a", "c1") == cluster_token(b"a", "c1")


def test_only_the_exact_token_is_carried() -> None:
    token = cluster_token(b"secret", "c")
    assert carries_token(token_metadata(token), token)
    assert carries_token([("other", "x"), (AUTH_KEY, token)], token)
    assert not carries_token([(AUTH_KEY, token[:-1])], token)
    assert not carries_token([], token) and not carries_token(None, token)


def test_protects_whole_services_and_single_methods() -> None:
    p = protects(["roadlog.v1.RaftPeer"], ["/roadlog.v1.Admin/Leave"])
    assert p("/roadlog.v1.RaftPeer/Stream") and p("/roadlog.v1.Admin/Leave")
    assert not p("/roadlog.v1.Admin/Status") and not p("/roadlog.v1.RaftPeerX/Stream")


class Details:
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = method
        self.invocation_metadata = metadata


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


async def _ok(request: Any, context: Any) -> str:
    return "handled"


async def _intercept(details: Details) -> grpc.RpcMethodHandler[Any, Any] | None:
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "unary": grpc.unary_unary_rpc_method_handler(_ok),
        "stream": grpc.stream_stream_rpc_method_handler(_ok),
    }
    auth = ClusterAuth("tok", protects(["svc.Peer"]))

    async def continuation(d: Any) -> grpc.RpcMethodHandler[Any, Any] | None:
        return handlers.get(d.method.rpartition("/")[2])

    return await auth.intercept_service(continuation, details)  # type: ignore[arg-type]


def behaviour(h: grpc.RpcMethodHandler[Any, Any]) -> Any:
    return h.stream_stream if h.request_streaming else h.unary_unary


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_a_protected_call_without_the_token_never_reaches_its_handler(kind: str) -> None:
    async def go() -> None:
        refused = await _intercept(Details(f"/svc.Peer/{kind}", (("x", "y"),)))
        assert refused is not None
        assert refused.request_streaming == (kind == "stream")
        assert refused.response_streaming == (kind == "stream")
        with pytest.raises(Aborted) as e:
            await behaviour(refused)(None, Context())
        assert e.value.args == (grpc.StatusCode.UNAUTHENTICATED, REFUSED)

        allowed = await _intercept(Details(f"/svc.Peer/{kind}", token_metadata("tok")))
        assert allowed is not None
        assert await behaviour(allowed)(None, Context()) == "handled"

        public = await _intercept(Details(f"/svc.Client/{kind}", ()))
        assert public is not None
        assert await behaviour(public)(None, Context()) == "handled"
        assert await _intercept(Details("/svc.Peer/missing", ())) is None

    asyncio.run(go())
