"""The ops endpoint: /healthz, /readyz (200 or 503 with the detail), /metrics."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from roadlog.runtime.health import serve_metrics_and_health

pytestmark = pytest.mark.unit


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
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
