"""Self-registration is bounded for real (issue 39, finding 2) on a real
cluster (TLS, tokens): registrations from many addresses of one /24, over
HTTP and gRPC, share one rate, and past it HTTP answers 429 with
Retry-After and gRPC RESOURCE_EXHAUSTED, while another /24 still
registers. It fails on the rate per exact address (each address, and each
API's spelling of it, had its own)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from roadlog.client import Admin, Connection
from roadlog.client_tls import ClientTLS
from roadlog.rpc import SERVICE
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import clients_pb2

pytestmark = pytest.mark.integration

RATE = 6


def register_http(lc: LocalCluster, source: str) -> tuple[int, dict[str, str], Any]:
    """POST /v1/clients with no credential, from ``source`` (a loopback address)."""
    host, _, port = lc.queue_servers[0].http.removeprefix("https://").rpartition(":")
    ctx = ClientTLS.from_env().ssl_context()
    conn = http.client.HTTPSConnection(
        host, int(port), context=ctx, timeout=30, source_address=(source, 0)
    )
    try:
        conn.request(
            "POST", "/v1/clients", body=b"{}", headers={"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), json.loads(r.read())
    finally:
        conn.close()


def test_registrations_from_one_24_share_one_rate_over_http_and_grpc(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    lc = make_cluster(3, 1, queue_extra=["--registrations-per-minute", str(RATE)])
    anonymous = ClientTLS.from_env().with_token(None)
    with Connection(lc.servers, tls=anonymous) as conn:
        for _ in range(RATE // 2):  # gRPC, from 127.0.0.1
            assert Admin(conn).register_client().token.startswith("rl_")
        for i in range(RATE // 2):  # HTTP, from other addresses of 127.0.0.0/24
            code, _, body = register_http(lc, f"127.0.0.{10 + i}")
            assert code == 201, body
        # The rate of 127.0.0.0/24 is spent, whatever the address or the API.
        code, headers, body = register_http(lc, "127.0.0.99")
        assert code == 429, body
        error = body["error"]
        assert error["code"] == "RESOURCE_EXHAUSTED" and "127.0.0.0/24" in error["reason"]
        assert int(headers["Retry-After"]) >= 1
        # gRPC, one call (the SDK would retry it once the rate allows).
        with anonymous.channel(lc.servers[0]) as ch:
            call: Any = ch.unary_unary(f"/{SERVICE}/RegisterClient")
            with pytest.raises(grpc.RpcError) as refused:
                call(clients_pb2.RegisterClientRequest().SerializeToString(), timeout=20)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Another /24 has its own.
    code, _, body = register_http(lc, "127.0.1.10")
    assert code == 201, body
