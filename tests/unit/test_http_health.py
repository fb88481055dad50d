"""The ops endpoint: /healthz, /readyz (200 or 503 with the detail), /metrics."""

from __future__ import annotations

import json
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
