"""The cluster's CA and its certificates: what each names, the key files'
modes (made 0600, refused when open to anyone else), the CLI, and TLS gRPC
ports that refuse plaintext callers and certificates of another CA."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner
from grpc_health.v1 import health_pb2, health_pb2_grpc

from roadlog.cli import cli
from roadlog.client_tls import ClientTLS
from roadlog.runtime.config import ConfigError
from roadlog.runtime.tls import (
    CertAuth,
    Credentials,
    Identity,
    Security,
    check_key_file,
    grpc_identity,
    load_security,
)
from roadlog.tools.ca import CAError, create_ca, create_cert, list_certs
from tests.certs import ClusterCA

pytestmark = pytest.mark.unit


def test_identities_parse_only_known_kinds() -> None:
    assert Identity.parse("node:3") == Identity("node", "3")
    assert Identity.parse("node:3").node_id == 3  # type: ignore[union-attr]
    assert Identity.parse("client:admin").node_id == 0  # type: ignore[union-attr]
    for bad in ("node:0", "node:x", "node:", "root:1", "node3", ""):
        assert Identity.parse(bad) is None, bad


def test_certificates_name_their_holder_and_keys_are_private(test_ca: ClusterCA) -> None:
    c = test_ca.creds("node", 3)
    assert c.identity == Identity("node", "3")
    assert test_ca.creds("queue").identity.kind == "queue"
    assert test_ca.creds("client").identity == Identity("client", "admin")
    for d in (test_ca.node(3), test_ca.queue(), test_ca.client()):
        for key in d.glob("*.key"):
            assert key.stat().st_mode & 0o777 == 0o600, key
    assert test_ca.ca_key.stat().st_mode & 0o777 == 0o600
    names = {i.file: i for i in list_certs(test_ca.node(3))}
    assert names["ca.crt"].ca and names["node.crt"].subject == "node:3"
    assert "127.0.0.1" in names["node.crt"].hosts


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_key_open_to_group_or_others_is_refused(
    test_ca: ClusterCA, tmp_path: Path, mode: int
) -> None:
    d = tmp_path / "n"
    for f in test_ca.node(2).iterdir():
        (d / f.name).parent.mkdir(exist_ok=True)
        (d / f.name).write_bytes(f.read_bytes())
        (d / f.name).chmod(0o600)
    (d / "node.key").chmod(mode)
    with pytest.raises(ConfigError, match=r"node.key: readable .* chmod 600"):
        Credentials.load(d, "node")
    (d / "node.key").chmod(0o600)
    assert Credentials.load(d, "node").identity.node_id == 2


def test_missing_credentials_are_refused_unless_insecure(
    test_ca: ClusterCA, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="certs_dir: not set"):
        load_security(None, False, "node")
    with pytest.raises(ConfigError, match=r"no ca\.crt"):
        load_security(tmp_path, False, "node")
    assert load_security(None, True, "node").insecure
    with pytest.raises(ConfigError, match="names queue:queue, not a node"):
        Credentials.load(_renamed(test_ca.queue(), tmp_path / "q", "queue", "node"), "node")


def _renamed(src: Path, dst: Path, old: str, new: str) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        target = dst / f.name.replace(old, new)
        target.write_bytes(f.read_bytes())
        target.chmod(f.stat().st_mode & 0o777)
    return dst


def test_a_key_of_another_certificate_is_refused(test_ca: ClusterCA, tmp_path: Path) -> None:
    d = _renamed(test_ca.node(4), tmp_path / "n", "x", "x")
    (d / "node.key").write_bytes((test_ca.node(5) / "node.key").read_bytes())
    with pytest.raises(ConfigError, match="do not load together"):
        Credentials.load(d, "node")


def test_check_key_file_wants_0600(tmp_path: Path) -> None:
    k = tmp_path / "k"
    k.write_text("x")
    k.chmod(0o600)
    check_key_file(k)
    k.chmod(0o400)
    check_key_file(k)
    k.chmod(0o620)
    with pytest.raises(ConfigError):
        check_key_file(k)


def test_the_ca_is_never_overwritten_unasked(tmp_path: Path) -> None:
    create_ca(tmp_path, tmp_path / "ca.key")
    with pytest.raises(CAError, match="exists"):
        create_ca(tmp_path, tmp_path / "ca.key")
    create_cert(tmp_path, tmp_path / "ca.key", Identity("client", "ops"))
    with pytest.raises(CAError, match="exists"):
        create_cert(tmp_path, tmp_path / "ca.key", Identity("client", "ops"))
    (tmp_path / "ca.key").chmod(0o644)
    with pytest.raises(CAError, match="chmod 600"):
        create_cert(tmp_path, tmp_path / "ca.key", Identity("client", "other"))


def test_the_cli_makes_a_ca_and_certificates(tmp_path: Path) -> None:
    r = CliRunner()
    d, key = tmp_path / "certs", tmp_path / "ca.key"
    base = ["ca", "--help"]
    assert r.invoke(cli, base).exit_code == 0
    res = r.invoke(cli, ["ca", "create-ca", "--certs-dir", str(d), "--ca-key", str(key)])
    assert res.exit_code == 0, res.output
    for args in (
        ["create-node", "--node-id", "7", "10.0.0.7", "n7.example"],
        ["create-queue", "10.0.0.9"],
        ["create-client", "spark"],
    ):
        res = r.invoke(cli, ["ca", args[0], "--certs-dir", str(d), "--ca-key", str(key), *args[1:]])
        assert res.exit_code == 0, res.output
    res = r.invoke(cli, ["ca", "list", "--certs-dir", str(d), "--json"])
    listed = {i["file"]: i for i in json.loads(res.output)}
    assert listed["node.crt"]["subject"] == "node:7"
    assert set(listed["node.crt"]["hosts"]) == {"10.0.0.7", "n7.example"}
    assert listed["client.spark.crt"]["subject"] == "client:spark"
    assert {p.name for p in d.glob("*.key")} == {"node.key", "queue.key", "client.spark.key"}
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in [*d.glob("*.key"), key])
    again = r.invoke(cli, ["ca", "create-ca", "--certs-dir", str(d), "--ca-key", str(key)])
    assert again.exit_code != 0 and "exists" in again.output
    missing = r.invoke(cli, ["ca", "create-client", "--certs-dir", str(tmp_path / "none"),
                             "--ca-key", str(key), "x"])  # fmt: skip
    assert missing.exit_code != 0 and "roadlog ca create-ca" in missing.output


# ------------------------------------------------------------------ gRPC ports


class _Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.callers: list[Identity | None] = []

    async def Check(self, request: Any, context: Any) -> Any:
        self.callers.append(grpc_identity(context))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _serve(security: Security, mutual: bool, allowed: Any = None) -> tuple[Any, int, _Health]:
    interceptors = [CertAuth(allowed)] if allowed is not None else []
    server = grpc.aio.server(interceptors=interceptors)
    h = _Health()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    port = security.add_port(server, "127.0.0.1:0", mutual=mutual)
    await server.start()
    return server, port, h


async def _check(security: Security, port: int) -> grpc.StatusCode:
    async with security.channel(f"127.0.0.1:{port}") as ch:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_mutual_ports_know_the_caller_and_refuse_strangers(
    test_ca: ClusterCA, foreign_ca: ClusterCA
) -> None:
    async def main() -> None:
        server, port, h = await _serve(test_ca.security("node", 1), mutual=True)
        try:
            assert await _check(test_ca.security("node", 2), port) == grpc.StatusCode.OK
            assert h.callers == [Identity("node", "2")]
            assert await _check(Security(None), port) == grpc.StatusCode.UNAVAILABLE
            assert await _check(foreign_ca.security("node", 2), port) == grpc.StatusCode.UNAVAILABLE
            assert h.callers == [Identity("node", "2")]
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_cert_auth_refuses_kinds_not_allowed(test_ca: ClusterCA) -> None:
    async def main() -> None:
        server, port, _ = await _serve(
            test_ca.security("node", 1), mutual=True, allowed=lambda m: ("node",)
        )
        try:
            assert await _check(test_ca.security("node", 3), port) == grpc.StatusCode.OK
            code = await _check(test_ca.security("client"), port)
            assert code == grpc.StatusCode.PERMISSION_DENIED
        finally:
            await server.stop(None)
        server, port, _ = await _serve(
            test_ca.security("queue"), mutual=False, allowed=lambda m: ("node",)
        )
        try:  # a server-TLS port: no caller certificate, so protected calls are refused
            assert (
                await _check(test_ca.security("node", 3), port) == grpc.StatusCode.UNAUTHENTICATED
            )
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_a_client_checks_the_server_against_the_cluster_ca(
    test_ca: ClusterCA, foreign_ca: ClusterCA
) -> None:
    async def main() -> None:
        server, port, _ = await _serve(foreign_ca.security("queue"), mutual=False)
        try:
            assert await _check(test_ca.security("client"), port) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_ssl_contexts_verify_both_ends(test_ca: ClusterCA) -> None:
    c = test_ca.creds("node", 1)
    server, client = c.server_ssl(True), c.client_ssl()
    assert server.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    assert c.server_ssl(False).verify_mode == ssl.CERT_NONE
    assert os.path.exists(c.ca_file)


class _Recorder(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.tokens: list[list[str]] = []

    async def Check(self, request: Any, context: Any) -> Any:
        md = context.invocation_metadata() or ()
        self.tokens.append([v for k, v in md if k == "authorization"])
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_a_blocking_tls_channel_sends_the_token_with_every_call_and_closes(
    test_ca: ClusterCA,
) -> None:
    """``ClientTLS.channel`` carries the token from an interceptor (call
    credentials run a Python callback that can deadlock the channel's
    close on the GIL): every call has it once, and the channel closes."""
    tls = ClientTLS(
        ca_file=test_ca.ca_file,
        cert_file=test_ca.client() / "client.admin.crt",
        key_file=test_ca.client() / "client.admin.key",
        token="t0k3n",
    )

    def calls(port: int) -> None:
        for _ in range(20):  # a channel per call, as status polls do
            with tls.channel(f"127.0.0.1:{port}") as ch:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)

    async def main() -> list[list[str]]:
        server = grpc.aio.server()
        h = _Recorder()
        health_pb2_grpc.add_HealthServicer_to_server(h, server)
        port = test_ca.security("node", 1).add_port(server, "127.0.0.1:0", mutual=True)
        await server.start()
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(None, calls, port), 60
            )
        finally:
            await server.stop(None)
        return h.tokens

    assert asyncio.run(main()) == [["Bearer t0k3n"]] * 20
