"""The lab deploys ``metrics_auth`` token (inventory/lab.ini, issue 39): the
metrics ports of every node and queue server refuse a caller without the
bearer token, from outside the hosts, and answer with it; what must read
them still does (the roles' smoke checks in site.yml, Prometheus, fab's
probe here; the playbooks' own /readyz waits in test_lab.py)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import pytest

from tests.lab.conftest import PKI, Deployed, metrics_token

pytestmark = [pytest.mark.lab, pytest.mark.timeout(1800)]
PATHS = ("/metrics", "/healthz", "/readyz")


def status(url: str, token: str | None) -> tuple[int, dict[str, str]]:
    """The status of a GET from this machine (trusting the lab's CA) and its headers."""
    ctx = ssl.create_default_context(cafile=str(PKI / "client" / "ca.crt"))
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def test_the_metrics_ports_refuse_a_caller_without_the_token(deployed: Deployed) -> None:
    token = metrics_token(deployed.inventory)
    assert len(token) >= 32, "inventory/lab.ini deploys metrics_auth token"
    for h in deployed.hosts:
        conf = deployed.ssh(h, "cat /etc/roadlog/node.toml")
        assert 'metrics_auth = "token"' in conf, conf
    ports = [f"{h.ip}:9400" for h in deployed.hosts]
    ports += [s.replace(":7500", ":9500") for s in deployed.servers]
    for addr in ports:
        for path in PATHS:
            url = f"https://{addr}{path}"
            code, headers = status(url, None)
            assert code == 401 and "Bearer" in headers.get("WWW-Authenticate", ""), (url, code)
            assert status(url, "0" * 32 + token[32:])[0] == 401, url  # a wrong one
            assert status(url, token)[0] == 200, url


def test_fab_status_reads_the_ports_with_the_token(deployed: Deployed) -> None:
    """fab's probe sends the node's metrics token (its node.toml names the
    file). The playbooks' waits with the token are run by test_lab.py
    (rolling_restart.yml, backup and restore, add_node.yml: each waits on
    /readyz, and fails refused)."""
    status = json.loads(deployed.fab("status", "--json"))
    assert status["healthy"], status
    assert all(r["ready"] for r in status["hosts"]), status
