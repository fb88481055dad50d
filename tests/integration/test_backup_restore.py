"""Backups taken from a running node, and a whole cluster restored from one
(`roadlog-node backup` / `roadlog-node restore`, what backup.yml and
restore.yml run on the hosts)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from roadlog.client import Connection, Producer
from roadlog.status import ask_node
from roadlog.tools.localcluster import LocalCluster, NodeInfo
from tests.integration.conftest import create_topic, make_pings, read_topic, settled, wait_for
from tests.integration.test_replicated_log import digest

pytestmark = pytest.mark.integration
MakeCluster = Callable[..., LocalCluster]


def node_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node_daemon.process.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def backup_key(tmp_path: Path) -> list[str]:
    """--backup-key-file with a private key (issue 19, finding 14)."""
    key = tmp_path / "backup.key"
    key.write_text("0123456789abcdef2b7e151628aed2a6\n")
    key.chmod(0o600)
    return ["--backup-key-file", str(key)]


def take(data_dir: str, out: Path, key: list[str]) -> dict[str, Any]:
    """`roadlog-node backup` of a (running) node's data; its manifest."""
    r = node_cli(
        "backup", "--data-dir", data_dir, "--cluster-name", "roadlog", "--out", str(out),
        "--json", *key,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    manifest: dict[str, Any] = json.loads(r.stdout)
    return manifest


def restore(n: NodeInfo, backup: Path, voters: str, key: list[str]) -> None:
    """`roadlog-node restore` of a stopped node from ``backup``."""
    r = node_cli(
        "restore", "--data-dir", n.data_dir, "--cluster-name", "roadlog",
        "--listen", n.address, "--from", str(backup), "--voters", voters, *key,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def two_thousand(conn: Connection, partitions: int = 4) -> tuple[Producer, set[tuple[str, int]]]:
    """Topic munich with 2000 acknowledged pings; its producer and the pings."""
    create_topic(conn, partitions=partitions)
    p = Producer(conn, "munich")
    for k in range(4):
        p.send_batch(make_pings("p", k * 500, 500))
    p.flush()
    before = stored(conn)
    assert len(before) == 2000
    return p, before


def stored(conn: Connection) -> set[tuple[str, int]]:
    return {row for rows in read_topic(conn, "munich").values() for row in rows}


def test_a_cluster_restored_from_a_live_backup_holds_exactly_the_backed_up_state(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    lc = make_cluster(nodes=3)
    with Connection(lc.servers) as conn:
        p, before = two_thousand(conn)
        # Every node applies what was acknowledged before it is backed up.
        wait_for(lambda: len({digest(n.address) for n in lc.nodes}) == 1, 30, "equal replicas")
        # Taken while the node runs.
        backup = tmp_path / "backup"
        key = backup_key(tmp_path)
        manifest = take(lc.nodes[0].data_dir, backup, key)
        assert manifest["applied_index"] > 0 and manifest["cluster_name"] == "roadlog"
        # Issue 19, findings 14 and 18: backups and a node's data are its user's alone.
        for root in (backup, Path(lc.nodes[0].data_dir)):
            exposed = [p for p in root.rglob("*") if p.stat().st_mode & 0o077]
            assert not exposed, [f"{p} {p.stat().st_mode:o}" for p in exposed]
        p.send_batch(make_pings("p", 2000, 700))  # after the backup: gone after a restore
        p.flush()
        assert len(stored(conn)) == 2700
        # A running node refuses to be restored over.
        voters = ",".join(f"{n.id}={n.address}" for n in lc.nodes)
        r = node_cli(
            "restore", "--data-dir", lc.nodes[1].data_dir, "--cluster-name", "roadlog",
            "--listen", lc.nodes[1].address, "--from", str(backup), "--voters", voters, *key,
        )  # fmt: skip
        assert r.returncode != 0 and "stop it" in r.stderr
    lc.down()
    for n in lc.nodes:
        restore(n, backup, voters, key)
        aside = list(Path(n.data_dir).glob("pre-restore-*"))
        assert aside and (aside[0] / "state" / "data.mdb").exists(), "old data kept aside"
    lc.start_all()
    lc.wait_ready(60)
    with Connection(lc.servers) as conn:
        assert stored(conn) == before
        digests = {digest(n.address) for n in lc.nodes}
        assert len(digests) == 1, f"replicas differ after the restore: {digests}"
        # The restored cluster takes writes again.
        Producer(conn, "munich").send_batch(make_pings("q", 0, 100))
        assert len(stored(conn)) == 2100


def test_a_corrupt_or_foreign_backup_is_refused_and_the_node_keeps_its_data(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    lc = make_cluster(nodes=1)
    with Connection(lc.servers) as conn:
        create_topic(conn)
        Producer(conn, "munich").send_batch(make_pings("p", 0, 300))
    node = lc.nodes[0]
    backup = tmp_path / "b"
    key = backup_key(tmp_path)
    assert (
        node_cli("backup", "--data-dir", node.data_dir, "--out", str(backup), *key).returncode == 0
    )
    r = node_cli("backup", "--data-dir", node.data_dir, "--out", str(backup), *key)
    assert r.returncode != 0 and "not empty" in r.stderr
    lc.down()
    voters = f"{node.id}={node.address}"
    args = ["--data-dir", node.data_dir, "--listen", node.address, "--voters", voters, *key]
    r = node_cli("restore", *args, "--cluster-name", "berlin", "--from", str(backup))
    assert r.returncode != 0 and "cluster 'roadlog'" in r.stderr
    state = backup / "state.mdb"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    r = node_cli("restore", *args, "--from", str(backup))
    assert r.returncode != 0 and "SHA-256" in r.stderr
    assert not list(Path(node.data_dir).glob("pre-restore-*")), "a refused restore moved data"
    lc.start_all()
    lc.wait_ready(60)
    with Connection(lc.servers) as conn:
        assert len(stored(conn)) == 300
    # The node's ops endpoint: live, ready with its role, and metrics.
    with urllib.request.urlopen(lc.metrics_url(node, "/readyz"), timeout=5) as r2:
        ready = json.loads(r2.read())
    assert ready["ready"] is True and ready["role"] == "leader" and ready["member"] is True
    with urllib.request.urlopen(lc.metrics_url(node, "/healthz"), timeout=5) as r2:
        assert json.loads(r2.read())["live"] is True


def _group_applied(lc: LocalCluster) -> list[dict[int, int]]:
    """Each node's applied index in each group it runs."""
    out = []
    for n in lc.nodes:
        v = ask_node(n.address, 2.0, lc.tls())
        out.append({g["id"]: g["applied_index"] for g in v["groups"]} if v else {})
    return out


def test_a_cluster_with_data_groups_is_restored_with_every_group(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    """A topic placed in data groups keeps its pings in them: a backup holds
    every group's state, and a restore gives each group back its own."""
    lc = make_cluster(nodes=3, extra=["--data-groups", "3", "--place-topics"])
    with Connection(lc.servers) as conn:
        p, before = two_thousand(conn, partitions=6)

        def level() -> bool:
            seen = _group_applied(lc)
            return len(seen[0]) == 4 and all(a == seen[0] for a in seen)

        wait_for(level, 30, "every node applied every group")
        backup = tmp_path / "backup"
        key = backup_key(tmp_path)
        assert sorted(take(lc.nodes[0].data_dir, backup, key)["groups"]) == ["1", "2", "3"]
        p.send_batch(make_pings("p", 2000, 700))  # after the backup: gone after a restore
        p.flush()
    lc.down()
    voters = ",".join(f"{n.id}={n.address}" for n in lc.nodes)
    for n in lc.nodes:
        restore(n, backup, voters, key)
    lc.start_all()
    lc.wait_ready(60)
    with Connection(lc.servers) as conn:
        assert settled(lambda: stored(conn), lambda s: s == before, "the backed-up pings") == before
        Producer(conn, "munich").send_batch(make_pings("q", 0, 100))  # writes again
        assert len(stored(conn)) == 2100
