"""The ops endpoint: /healthz, /readyz (200 or 503 with the detail), /metrics."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from roadlog.client_tls import ClientTLS
from roadlog.runtime.health import serve_metrics_and_health
from tests.certs import ClusterCA

pytestmark = pytest.mark.unit


def get(port: int, path: str, ctx: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """``ctx``: over HTTPS with it; None: plaintext."""
    scheme = "http" if ctx is None else "https"
    try:
        with urllib.request.urlopen(
            f"{scheme}://127.0.0.1:{port}{path}", timeout=5, context=ctx
        ) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_readiness_follows_the_callback_and_a_failing_check_is_not_ready() -> None:
    state: dict[str, Any] = {"ok": False}

    def ready() -> tuple[bool, dict[str, Any]]:
        if state.get("boom"):
            raise RuntimeError("status unavailable")
        return state["ok"], {"role": "follower", "leader": 0}

    server = serve_metrics_and_health("127.0.0.1", 0, ready)
    port = server.server_port
    try:
        code, body = get(port, "/readyz")
        assert code == 503 and json.loads(body) == {"ready": False, "role": "follower", "leader": 0}
        code, body = get(port, "/healthz")
        assert code == 200 and json.loads(body)["live"] is True
        state["ok"] = True
        code, body = get(port, "/readyz")
        assert code == 200 and json.loads(body)["ready"] is True
        state["boom"] = True
        code, body = get(port, "/readyz")
        assert code == 503 and "status unavailable" in json.loads(body)["error"]
        code, body = get(port, "/metrics")
        assert code == 200 and b"python_info" in body
    finally:
        server.shutdown()
        server.server_close()


def test_half_sent_requests_neither_pile_up_threads_nor_stay_forever() -> None:
    """Issue 19, finding 12: 200 half-sent requests held a metrics port's
    threads for as long as the client liked."""
    server = serve_metrics_and_health(
        "127.0.0.1", 0, lambda: (True, {}), max_connections=4, idle_timeout_s=0.5
    )
    port = server.server_port
    before = threading.active_count()
    slow = []
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finished
            slow.append(s)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert threading.active_count() - before <= 2 * 4  # a thread and a timer a slot
            try:
                if get(port, "/healthz")[0] == 200:
                    break  # idle ones were dropped: the endpoint answers again
            except OSError:
                pass  # refused while every slot is held
            time.sleep(0.05)
        else:
            raise AssertionError("the endpoint never answered again")
        for s in slow:  # every half-sent request was closed by the server
            s.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(100) == b""
    finally:
        for s in slow:
            s.close()
        server.shutdown()
        server.server_close()


def test_a_slow_sender_is_cut_at_the_deadline() -> None:
    """A byte now and then keeps a per-read timeout happy; the connection's
    deadline still frees its slot."""
    server = serve_metrics_and_health(
        "127.0.0.1", 0, lambda: (True, {}), max_connections=2, idle_timeout_s=5, deadline_s=1
    )
    s = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
    try:
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        closed = False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not closed:
            try:
                s.sendall(b"X")  # one header byte at a time, never a whole request
                s.settimeout(0.2)
                closed = s.recv(100) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
        assert closed, "the slow sender kept its connection past the deadline"
        assert get(server.server_port, "/healthz")[0] == 200
    finally:
        s.close()
        server.shutdown()
        server.server_close()


def _ca_context(ca: ClusterCA) -> ssl.SSLContext:
    ctx = ClientTLS(ca.ca_file).ssl_context()
    assert ctx is not None
    return ctx


def test_with_tls_the_port_answers_only_over_https_to_clients_of_the_cluster_ca(
    test_ca: ClusterCA, foreign_ca: ClusterCA
) -> None:
    """Issue 19: a daemon with TLS serves /metrics and health over HTTPS
    with its certificate; a client trusting the cluster's CA gets through,
    a plaintext client and one trusting another CA do not."""
    server_ssl = test_ca.security("node", 1).server_ssl(mutual=False)
    server = serve_metrics_and_health(
        "127.0.0.1", 0, lambda: (True, {"role": "leader"}), ssl_context=server_ssl
    )
    port = server.server_port
    try:
        code, body = get(port, "/readyz", _ca_context(test_ca))
        assert code == 200 and json.loads(body) == {"ready": True, "role": "leader"}
        code, body = get(port, "/metrics", _ca_context(test_ca))
        assert code == 200 and b"roadlog_ready" in body
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            get(port, "/readyz")  # plaintext: the handshake fails, no answer
        with pytest.raises(urllib.error.URLError) as refused:
            get(port, "/readyz", _ca_context(foreign_ca))
        assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
        assert get(port, "/healthz", _ca_context(test_ca))[0] == 200  # still serving
    finally:
        server.shutdown()
        server.server_close()


def test_with_tls_a_silent_or_plaintext_caller_frees_its_slot(test_ca: ClusterCA) -> None:
    """A connection that never finishes its handshake holds a slot only
    until the idle timeout, like a half-sent request."""
    server_ssl = test_ca.security("queue").server_ssl(mutual=False)
    server = serve_metrics_and_health(
        "127.0.0.1",
        0,
        lambda: (True, {}),
        max_connections=2,
        idle_timeout_s=0.5,
        ssl_context=server_ssl,
    )
    port = server.server_port
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    try:
        silent[1].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # plaintext
        for s in silent:  # closed by the server, no HTTP answer
            s.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert not s.recv(100).startswith(b"HTTP/")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if get(port, "/healthz", _ca_context(test_ca))[0] == 200:
                    break
            except OSError:
                pass  # refused while both slots are held
            time.sleep(0.05)
        else:
            raise AssertionError("the endpoint never answered again")
    finally:
        for s in silent:
            s.close()
        server.shutdown()
        server.server_close()
