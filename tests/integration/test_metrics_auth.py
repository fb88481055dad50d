"""The metrics ports behind ``metrics_auth = "token"`` on a real cluster
(TLS, tokens; issue 39 item 6), and the identities' figures and the
idle-identity pipeline there (item 2): every node's and the queue
server's /metrics, /healthz and /readyz refuse a request without the
bearer token (401) and answer it with; the nodes export the identities
held against their cap; and a self-registered identity used is told to
group 0's leader (``ClientsUsed``) and keeps working through the trims
that carry it."""

from __future__ import annotations

import re
import secrets
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from roadlog.client import Admin, Connection
from roadlog.client_tls import ClientTLS
from roadlog.tools.localcluster import LocalCluster, NodeInfo, QueueInfo
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def scrape(
    lc: LocalCluster, p: NodeInfo | QueueInfo, path: str, token: str | None
) -> tuple[int, str]:
    req = urllib.request.Request(lc.metrics_url(p, path))
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, context=lc.ssl_context(), timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sample(text: str, name: str, labels: str = "") -> float | None:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, flags=re.M)
    return float(m.group(1)) if m else None


def test_metrics_ports_need_the_token_and_identities_are_counted_and_told_used(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    token = secrets.token_hex(32)
    token_file = tmp_path / "metrics_token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    auth = ["--metrics-auth", "token", "--metrics-token-file", str(token_file)]
    lc = make_cluster(
        3,
        1,
        extra=[*auth, "--trim-interval-s", "1"],
        queue_extra=[*auth, "--clients-used-report-s", "0.5"],
    )
    procs: list[NodeInfo | QueueInfo] = [*lc.nodes, *lc.queue_servers]
    for p in procs:
        for path in ("/metrics", "/healthz", "/readyz"):
            code, body = scrape(lc, p, path, None)
            assert code == 401 and "roadlog_" not in body, (p.name, path, code)
            assert scrape(lc, p, path, "rl_" + token[3:])[0] == 401
            assert scrape(lc, p, path, token)[0] in (200, 503), (
                p.name,
                path,
            )  # /readyz: 503 is fine
    # A phone registers and publishes nothing but its Status: its token is used.
    with Connection(lc.servers, tls=ClientTLS.from_env().with_token(None)) as conn:
        phone = Admin(conn).register_client()
    phone_tls = ClientTLS.from_env().with_token(phone.token)

    def registered() -> float | None:
        text = scrape(lc, lc.nodes[0], "/metrics", token)[1]
        n = sample(text, "roadlog_identities", '{kind="registered"}')
        ratio = sample(text, "roadlog_identity_cap_fill_ratio", '{kind="registered"}')
        cap = sample(text, "roadlog_identities_cap", '{kind="registered"}')
        return n if n and cap == 1_000_000 and ratio == n / cap else None

    wait_for(registered, 30, "the node exports the self-registered identity against its cap")

    def told() -> float | None:
        with Connection(lc.servers, tls=phone_tls) as conn:
            Admin(conn).status()  # a call with the phone's token
        text = scrape(lc, lc.queue_servers[0], "/metrics", token)[1]
        labels = '{method="ClientsUsed",outcome="ok"}'
        return sample(text, "roadlog_queue_answer_seconds_count", labels)

    wait_for(told, 30, "the queue server told group 0's leader the identity was used")
    # Trims carried it (every second); the identity still works.
    with Connection(lc.servers, tls=phone_tls) as conn:
        assert Admin(conn).status().leader
