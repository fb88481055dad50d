"""Who may read a metrics port (``metrics_auth``, issue 39 item 6), on a
real endpoint: ``none`` answers anyone, as before; ``token`` refuses a
request without the bearer token of ``metrics_token_file`` (401) and
answers it with; ``tls`` refuses a caller without a client certificate
(403), answers one the cluster's CA signed, and fails the handshake of one
a foreign CA signed; a weak or exposed token file, or ``tls`` without TLS,
stops the daemon at start."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from roadlog.runtime.config import ConfigError
from roadlog.runtime.health import metrics_auth, metrics_ssl, serve_metrics_and_health
from tests.certs import ClusterCA

pytestmark = pytest.mark.unit

PATHS = ("/metrics", "/healthz", "/readyz")
TOKEN = "3f9a1c7e5b2d4086a1e9c3b7f5d20486e1a9c7b3d5f2084a6c1e9b7d3f5a2086"


def get(
    port: int, path: str, ctx: ssl.SSLContext | None = None, token: str | None = None
) -> tuple[int, bytes, dict[str, str]]:
    scheme = "http" if ctx is None else "https"
    req = urllib.request.Request(f"{scheme}://127.0.0.1:{port}{path}")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@contextmanager
def served(
    auth_mode: str, token_file: Path | None = None, security: object = None
) -> Iterator[int]:
    auth = metrics_auth(auth_mode, token_file, insecure=security is None)
    ctx = metrics_ssl(security, auth) if security is not None else None
    server = serve_metrics_and_health(
        "127.0.0.1", 0, lambda: (True, {}), ssl_context=ctx, auth=auth
    )
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


def token_file(tmp_path: Path, value: str = TOKEN, mode: int = 0o600) -> Path:
    path = tmp_path / "metrics_token"
    path.write_text(value + "\n")
    path.chmod(mode)
    return path


def trusting(ca: ClusterCA, holder: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca.ca_file))
    if holder is not None:
        [crt] = [p for p in holder.glob("*.crt") if p.name != "ca.crt"]
        ctx.load_cert_chain(crt, crt.with_suffix(".key"))
    return ctx


def test_none_answers_anyone_as_before() -> None:
    with served("none") as port:
        for path in PATHS:
            assert get(port, path)[0] == 200, path


def test_token_refuses_without_it_and_answers_with_it(tmp_path: Path) -> None:
    with served("token", token_file(tmp_path)) as port:
        for path in PATHS:
            code, body, headers = get(port, path)
            assert code == 401, path
            assert headers["WWW-Authenticate"].startswith("Bearer")
            assert b"roadlog_" not in body and b"python_info" not in body
            assert get(port, path, token=TOKEN[:-1] + "0")[0] == 401
            assert get(port, path, token="")[0] == 401
            assert get(port, path, token=TOKEN)[0] == 200, path
        assert b"python_info" in get(port, "/metrics", token=TOKEN)[1]


def test_tls_asks_for_a_client_certificate_of_the_cluster(
    test_ca: ClusterCA, foreign_ca: ClusterCA
) -> None:
    with served("tls", security=test_ca.security("node", 1)) as port:
        for path in PATHS:
            code, body, _ = get(port, path, trusting(test_ca))
            assert code == 403 and b"python_info" not in body, path
            assert get(port, path, trusting(test_ca, test_ca.client()))[0] == 200, path
        with pytest.raises(
            OSError
        ):  # the handshake fails (URLError, or SSLError after it in TLS 1.3)
            get(port, "/metrics", trusting(test_ca, foreign_ca.client()))
    # The daemon's other HTTPS ports' context is left as it was.
    shared = test_ca.security("node", 1).server_ssl(mutual=False)
    assert shared is not None and shared.verify_mode == ssl.CERT_NONE


def test_a_weak_exposed_or_missing_token_and_tls_without_tls_stop_the_start(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="metrics_token_file"):
        metrics_auth("token", None, insecure=True)
    with pytest.raises(ConfigError, match="repeated"):
        metrics_auth("token", token_file(tmp_path, "a" * 64), insecure=True)
    with pytest.raises(ConfigError, match="open to"):
        metrics_auth("token", token_file(tmp_path, mode=0o644), insecure=True)
    with pytest.raises(ConfigError, match="needs TLS"):
        metrics_auth("tls", None, insecure=True)
    with pytest.raises(ConfigError, match="one of none, token, tls"):
        metrics_auth("basic", None, insecure=True)
