"""fab's status probe (``fabfile.READYZ``, run on each node's host) asks
/readyz where the node's metrics port binds: ``metrics_host`` from
node.toml (the roles set it to the host's private address: issue 19,
finding 15), else ``listen``'s host, and 127.0.0.1 where that is every
address; over HTTPS, trusting the CA of the node's ``certs_dir``."""

from __future__ import annotations

import importlib
import json
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from roadlog.runtime.health import MetricsAuth, serve_metrics_and_health
from roadlog.runtime.tls import Identity, server_context
from roadlog.tools.ca import copy_ca, create_cert
from tests.certs import ClusterCA

pytestmark = pytest.mark.unit

fabfile: Any = importlib.import_module("fabfile")


@pytest.fixture
def certs(test_ca: ClusterCA, tmp_path: Path) -> Path:
    """A node's certs dir whose certificate is valid for 127.0.0.1 and 127.0.0.2."""
    d = tmp_path / "certs"
    copy_ca(test_ca.ca_dir, d)
    create_cert(d, test_ca.ca_key, Identity("node", "1"), ["127.0.0.1", "127.0.0.2"])
    return d


@pytest.fixture
def ready_on() -> Iterator[Callable[[str, Path], int]]:
    """Start a node's metrics port (HTTPS, always ready) on an address; its port."""
    servers: list[Any] = []

    def start(host: str, certs: Path) -> int:
        ctx = server_context(certs / "node.crt", certs / "node.key", certs / "ca.crt", False)
        server = serve_metrics_and_health(
            host, 0, lambda: (True, {"role": "leader"}), ssl_context=ctx
        )
        servers.append(server)
        return int(server.server_port)

    yield start
    for s in servers:
        s.shutdown()


@pytest.mark.parametrize(
    ("bound", "toml"),
    [
        ("127.0.0.2", 'listen = "0.0.0.0:7400"\nmetrics_host = "127.0.0.2"\n'),
        ("127.0.0.2", 'listen = "127.0.0.2:7400"\nmetrics_host = ""\n'),
        ("127.0.0.1", 'listen = "0.0.0.0:7400"\n'),  # every address: loopback answers
    ],
)
def test_fab_asks_readyz_where_the_metrics_port_binds(
    bound: str,
    toml: str,
    certs: Path,
    ready_on: Callable[[str, Path], int],
    tmp_path: Path,
) -> None:
    port = ready_on(bound, certs)
    config = tmp_path / "node.toml"
    config.write_text(toml + f'certs_dir = "{certs}"\n')
    out = subprocess.run(
        [sys.executable, "-c", fabfile.READYZ, str(port), str(config)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout) == {"ready": True, "role": "leader"}


TOKEN = "3f9a1c7e5b2d4086a1e9c3b7f5d20486e1a9c7b3d5f2084a6c1e9b7d3f5a2086"


def probe(port: int, config: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", fabfile.READYZ, str(port), str(config)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return out.stdout.strip()


@pytest.mark.parametrize("mode", ["token", "tls"])
def test_fab_shows_the_metrics_port_what_its_metrics_auth_asks_for(
    mode: str, certs: Path, tmp_path: Path
) -> None:
    """Issue 39: with the node's ``metrics_auth`` token, the probe sends the
    bearer token of its ``metrics_token_file``; with tls, the node's own
    certificate. The same probe with a node.toml that does not say so is
    refused (401 / 403), so fab would see no ready node."""
    (tmp_path / "metrics_token").write_text(TOKEN + "\n")
    ctx = server_context(certs / "node.crt", certs / "node.key", certs / "ca.crt", False)
    if mode == "tls":
        ctx.verify_mode = ssl.CERT_OPTIONAL  # as metrics_ssl: none presented is a 403
    server = serve_metrics_and_health(
        "127.0.0.1", 0, lambda: (True, {"role": "leader"}), ssl_context=ctx,
        auth=MetricsAuth(mode, TOKEN.encode()),
    )  # fmt: skip
    try:
        base = f'listen = "0.0.0.0:7400"\ncerts_dir = "{certs}"\n'
        bare, told = tmp_path / "bare.toml", tmp_path / "node.toml"
        bare.write_text(base)
        told.write_text(
            base + f'metrics_auth = "{mode}"\nmetrics_token_file = "{tmp_path}/metrics_token"\n'
        )
        refused = probe(server.server_port, bare)
        assert "Bearer" in refused if mode == "token" else "certificate" in refused, refused
        assert json.loads(probe(server.server_port, told)) == {"ready": True, "role": "leader"}
    finally:
        server.shutdown()
        server.server_close()
