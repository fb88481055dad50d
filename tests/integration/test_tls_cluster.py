"""A local cluster runs with TLS on every gRPC port, framed link and HTTP
port (the HTTP API and dashboard, every /metrics and health port): its
own clients get in, a plaintext client and a client holding a certificate
of another CA are refused on each of them, and the queue server's client
port gives no caller the Work stream."""

from __future__ import annotations

import asyncio
import http.client
import ssl
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from roadlog.client_tls import ClientTLS
from roadlog.runtime import tls
from roadlog.runtime.auth import cluster_token, token_metadata
from roadlog.runtime.config import read_secret
from roadlog.tools.localcluster import LocalCluster, NodeInfo, QueueInfo
from roadlog.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    client_pb2,
    client_pb2_grpc,
    noderead_pb2,
    noderead_pb2_grpc,
    work_pb2,
    work_pb2_grpc,
)
from tests.certs import ClusterCA
from tests.integration.conftest import framed_greeting, wait_for

pytestmark = pytest.mark.integration


def _flag(p: NodeInfo | QueueInfo, flag: str) -> int:
    return int(p.argv[p.argv.index(flag) + 1])


def _grpc_status(address: str, creds: ClientTLS, node: bool) -> grpc.StatusCode:
    with creds.channel(address) as ch:
        try:
            if node:
                admin_pb2_grpc.AdminStub(ch).Status(client_pb2.StatusRequest(), timeout=10)
            else:
                client_pb2_grpc.RoadlogStub(ch).Status(client_pb2.StatusRequest(), timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def _http_status(url: str, ctx: ssl.SSLContext | None) -> int | str:
    """The HTTP status ``url`` answers this caller, or why none came."""
    try:
        with urllib.request.urlopen(url, timeout=10, context=ctx) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError as e:
        return type(e.reason).__name__
    except (http.client.HTTPException, ConnectionError) as e:
        return type(e).__name__


def test_every_port_refuses_plaintext_and_a_foreign_ca(
    make_cluster: Callable[..., LocalCluster], test_ca: ClusterCA, foreign_ca: ClusterCA
) -> None:
    lc = make_cluster(3, 1)
    ours = lc.tls()
    plain = ClientTLS(insecure=True)
    client_dir = foreign_ca.client()
    foreign = ClientTLS(
        client_dir / "ca.crt", client_dir / "client.admin.crt", client_dir / "client.admin.key"
    )
    # A stranger who trusts our CA but holds a certificate of its own CA.
    stranger = ClientTLS(ours.ca_file, foreign.cert_file, foreign.key_file)
    for n in lc.nodes:
        assert _grpc_status(n.address, ours, node=True) == grpc.StatusCode.OK
        for who in (plain, foreign, stranger):
            assert _grpc_status(n.address, who, node=True) == grpc.StatusCode.UNAVAILABLE, who
    q = lc.queue_servers[0]
    assert _grpc_status(q.grpc, ours, node=False) == grpc.StatusCode.OK
    for who in (plain, foreign):
        assert _grpc_status(q.grpc, who, node=False) == grpc.StatusCode.UNAVAILABLE, who

    node1 = test_ca.creds("node", 1)
    good = node1.client_ssl()
    bad = foreign_ca.creds("node", 1).client_ssl()
    bad.load_verify_locations(cafile=str(test_ca.ca_file))  # it trusts our servers
    for port in [_flag(n, "--peer-frames-port") for n in lc.nodes] + [
        _flag(q, "--work-frames-port")
    ]:
        assert framed_greeting(port, good).startswith(b"RL"), port
        assert framed_greeting(port, None) == b"", port
        assert framed_greeting(port, bad) == b"", port

    # HTTP: the HTTP API (and dashboard) and every metrics/health port are
    # HTTPS with the process's certificate; only clients of our CA get an answer.
    ours_ssl, foreign_ssl = ours.ssl_context(), foreign.ssl_context()
    assert q.http.startswith("https://")
    urls = [f"{q.http}/healthz", f"{q.http}/ui/"]
    procs: list[NodeInfo | QueueInfo] = [*lc.nodes, q]
    urls += [lc.metrics_url(p, path) for p in procs for path in ("/readyz", "/metrics")]
    for url in urls:
        # A node a moment behind answers /readyz 503 at first (over TLS too).
        wait_for(lambda url=url: _http_status(url, ours_ssl) == 200, 30, url)  # type: ignore[misc]
        assert _http_status(url, foreign_ssl) == "SSLCertVerificationError", url
        plaintext = _http_status(url.replace("https://", "http://", 1), None)
        assert not isinstance(plaintext, int), (url, plaintext)  # no HTTP answer at all


def test_the_client_port_gives_nobody_the_work_stream(
    make_cluster: Callable[..., LocalCluster], test_ca: ClusterCA
) -> None:
    """Even a node's certificate: the client port asks for none, so a Pull
    there never reaches the queues (nodes pull over the mutual framed link)."""
    lc = make_cluster(1, 1)
    node = tls.Security(test_ca.creds("node", 1))
    # With the cluster token too: only the missing client certificate refuses it.
    token = cluster_token(read_secret(Path(lc.secret_file)), "roadlog")

    async def pull() -> grpc.StatusCode:
        async with node.channel(lc.queue_servers[0].grpc) as ch:
            # Nothing sent: a message racing the server's refusal made the
            # call end INTERNAL (a reset stream) now and then, not with
            # the refusal's own code.
            async def messages() -> AsyncIterator[work_pb2.WorkerMessage]:
                return
                yield  # an async generator that yields nothing

            try:
                async for _ in work_pb2_grpc.WorkStub(ch).Pull(
                    messages(), metadata=token_metadata(token), timeout=10
                ):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    assert asyncio.run(pull()) == grpc.StatusCode.UNAUTHENTICATED


def test_with_tls_the_cluster_token_is_no_peer_credential(
    make_cluster: Callable[..., LocalCluster], test_ca: ClusterCA
) -> None:
    """Issue 19, finding 4: a node's certificate alone passes the changing
    admin calls, a client's certificate alone reads from the nodes (Spark
    needs no secret), and an operator's changing call still needs the
    token on top of its client certificate."""
    lc = make_cluster(1, 1)
    node, client = lc.nodes[0].address, test_ca.security("client")

    async def calls() -> dict[str, grpc.StatusCode]:
        out: dict[str, grpc.StatusCode] = {}

        async def code(name: str, call: Any) -> None:
            try:
                await call
                out[name] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                out[name] = e.code()

        async with client.channel(node) as ch:
            plan = noderead_pb2_grpc.NodeReadStub(ch).Plan(
                noderead_pb2.PlanRequest(topic="nothing-here"), timeout=10
            )
            await code("client reads", plan)
            remove = admin_pb2_grpc.AdminStub(ch).RemoveNode(
                admin_pb2.RemoveNodeRequest(node_id=99), timeout=10
            )
            await code("client changes without the token", remove)
        async with test_ca.security("node", 1).channel(node) as ch:
            snap = admin_pb2_grpc.AdminStub(ch).Snapshot(admin_pb2.SnapshotNowRequest(), timeout=30)
            await code("node changes without the token", snap)
        return out

    got = asyncio.run(calls())
    assert got["client changes without the token"] == grpc.StatusCode.UNAUTHENTICATED
    assert got["node changes without the token"] == grpc.StatusCode.OK
    # Not refused for credentials: the topic is unknown.
    assert got["client reads"] not in (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    ), got
