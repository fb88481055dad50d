"""The playbooks' own /readyz waits show the metrics ports what their
``metrics_auth`` asks for (issue 39): the bearer token of the file the role
roadlog_common installs (``metrics_token.yml`` reads it on the host), or the
daemon's own certificate with tls, as the roles' smoke checks do.

``tasks/cluster_healthy.yml`` (rolling_restart.yml, add_node.yml and
restore.yml wait with it) runs for real against a metrics endpoint on
loopback, by Ansible on this machine; every other /readyz wait of the
playbooks is checked to send the same credential."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from roadlog.runtime.health import MetricsAuth, serve_metrics_and_health
from roadlog.runtime.tls import server_context
from tests.certs import ClusterCA

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "3f9a1c7e5b2d4086a1e9c3b7f5d20486e1a9c7b3d5f2084a6c1e9b7d3f5a2086"
PLAYBOOK = """
- hosts: nodes
  gather_facts: false
  tasks:
    - ansible.builtin.include_tasks: {tasks}/cluster_healthy.yml
"""


@pytest.fixture
def served(test_ca: ClusterCA) -> Iterator[Any]:
    """Start a node's metrics port (HTTPS, ready, a member) with a mode."""
    servers: list[Any] = []
    certs = test_ca.node(1)

    def start(mode: str) -> int:
        ctx = server_context(certs / "node.crt", certs / "node.key", certs / "ca.crt", False)
        if mode == "tls":
            ctx.verify_mode = ssl.CERT_OPTIONAL  # as metrics_ssl: none presented is a 403
        server = serve_metrics_and_health(
            "127.0.0.1", 0, lambda: (True, {"member": True}), ssl_context=ctx,
            auth=MetricsAuth(mode, TOKEN.encode()),
        )  # fmt: skip
        servers.append(server)
        return int(server.server_port)

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def wait_healthy(
    tmp_path: Path, certs: Path, port: int, mode: str
) -> subprocess.CompletedProcess[str]:
    """Run cluster_healthy.yml on this machine as the inventory's one node
    whose daemons run ``metrics_auth`` ``mode``."""
    config = tmp_path / "etc"
    config.mkdir(exist_ok=True)
    (config / "metrics_token").write_text(TOKEN + "\n")
    inventory = {
        "nodes": {
            "hosts": {"lab1": {"ansible_host": "127.0.0.1", "ansible_connection": "local"}},
            "vars": {
                "ansible_python_interpreter": sys.executable,
                "roadlog_node_insecure": False,
                "roadlog_common_certs_dir": str(certs),
                "roadlog_common_config_dir": str(config),
                "roadlog_common_metrics_auth": mode,
                "roadlog_node_metrics_auth": mode,
                "roadlog_node_metrics_host": "127.0.0.1",
                "roadlog_node_metrics_port": port,
                "roadlog_health_retries": 0,
            },
        }
    }
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    (tmp_path / "play.yml").write_text(PLAYBOOK.format(tasks=ROOT / "playbooks" / "tasks"))
    tool = Path(sys.executable).parent / "ansible-playbook"
    return subprocess.run(
        [str(tool), "-i", str(tmp_path / "inventory.json"), str(tmp_path / "play.yml")],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip


@pytest.mark.skipif(os.geteuid() != 0, reason="the waits read the token as root (become)")
@pytest.mark.parametrize("mode", ["token", "tls"])
def test_cluster_healthy_shows_the_node_its_metrics_auth(
    mode: str, served: Any, test_ca: ClusterCA, tmp_path: Path
) -> None:
    port = served(mode)
    ok = wait_healthy(tmp_path, test_ca.node(1), port, mode)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    # The same wait told "none" sends nothing: the port refuses it.
    (tmp_path / "none").mkdir()
    refused = wait_healthy(tmp_path / "none", test_ca.node(1), port, "none")
    assert refused.returncode != 0 and ("401" in refused.stdout or "403" in refused.stdout), (
        refused.stdout[-3000:]
    )


def readyz_waits() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every ``uri`` task of the playbooks that reads a metrics port."""

    def walk(tasks: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
        for t in tasks or []:
            if not isinstance(t, dict):
                continue
            for nested in ("tasks", "pre_tasks", "post_tasks", "block", "rescue", "always"):
                yield from walk(t.get(nested), where)
            uri = t.get("ansible.builtin.uri")
            if uri and "/readyz" in str(uri.get("url", "")):
                yield f"{where}: {t.get('name')}", t

    for path in sorted((ROOT / "playbooks").rglob("*.yml")):
        yield from walk(yaml.safe_load(path.read_text()), str(path.relative_to(ROOT)))


def test_every_readyz_wait_of_the_playbooks_sends_the_credential() -> None:
    waits = list(readyz_waits())
    assert len(waits) >= 5, [w for w, _ in waits]  # the 4 files' waits (issue 39)
    for where, task in waits:
        uri = task["ansible.builtin.uri"]
        assert "roadlog_metrics_headers" in str(uri.get("headers")), where
        for k in ("client_cert", "client_key"):
            assert "'tls'" in str(uri.get(k)), (where, k)
        assert "'token'" in str(task.get("no_log")), where
