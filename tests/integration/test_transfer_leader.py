"""`roadlog-node transfer-leader`: what rolling restarts and `fab
transfer-leader` use to move the leadership before a leader's host goes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from roadlog.tools.localcluster import LocalCluster
from tests.certs import make_test_ca
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration


def transfer(lc: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "node_daemon.process.main",
            "transfer-leader",
            "--address",
            lc.nodes[0].address,
            "--secret-file",
            lc.secret_file,
            "--certs-dir",  # the node's port is mutual TLS: its host's certificate
            lc.nodes[0].certs_dir,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_leadership_moves_to_the_chosen_or_most_caught_up_voter(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    lc = make_cluster(nodes=3)
    before = lc.status()["leader"]
    r = transfer(lc)
    assert r.returncode == 0, r.stderr
    moved = json.loads(r.stdout)
    assert moved["from"] == before and moved["to"] != before
    wait_for(lambda: lc.status()["leader"] == moved["to"], 10, "the new leader everywhere")
    r = transfer(lc, "--to", str(before))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {**json.loads(r.stdout), "from": moved["to"], "to": before}
    r = transfer(lc, "--to", "99")
    assert r.returncode != 0 and "node 99 is not one" in r.stderr
    # Another cluster's node (a certificate of another CA) is not let in; a
    # node of this one needs no cluster token (its certificate is its
    # credential: issue 19, finding 4), so another cluster name changes nothing.
    other = make_test_ca(tmp_path / "other-ca")
    bad = subprocess.run(
        [sys.executable, "-m", "node_daemon.process.main", "transfer-leader",
         "--address", lc.nodes[0].address, "--secret-file", lc.secret_file,
         "--certs-dir", str(other.node(1))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "no node answers" in bad.stderr, bad.stderr
    renamed = subprocess.run(
        [sys.executable, "-m", "node_daemon.process.main", "transfer-leader",
         "--address", lc.nodes[0].address, "--cluster-name", "other",
         "--secret-file", lc.secret_file, "--certs-dir", lc.nodes[0].certs_dir],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert renamed.returncode == 0, renamed.stderr
