"""A data directory written before the log store (issue 42) opens with it:
a cluster run by the release before (``BASELINE``, this repository's
commit, its tree exported into the test's directory) takes pings in its
data groups, each group's log in its own environment (``groups/<g>/raft``);
the same data directories then start with this tree's code, which moves
every group's log into its process's log store at start, and every ping
acknowledged before is read back once, in order, with more taken after."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from node_daemon.storage.log_store import read_env, store_dir, store_holds
from roadlog.client import Connection, Producer
from roadlog.tools.localcluster import LocalCluster
from tests.integration.conftest import assert_exactly_once_in_order, make_pings, read_topic
from tests.integration.releases import exported_release

pytestmark = pytest.mark.integration

# The release whose data directories this one must open: the last commit
# with one LMDB environment per data group's log.
BASELINE = "a335ca2"
NODE_ARGS = ["--data-groups", "3", "--place-topics", "--workers", "2"]

OLD_SIDE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from roadlog.client import Admin, Connection, Producer
    from roadlog.tools.localcluster import LocalCluster
    from tests.integration.conftest import REGION, make_pings
    directory, args = Path(sys.argv[1]), json.loads(sys.argv[2])
    lc = LocalCluster.create(directory, 3, 1, args, insecure=True)
    lc.start_all()
    try:
        lc.wait_ready(60)
        acked = []
        with Connection(lc.servers, tls=lc.tls(), token=lc.admin_token) as conn:
            Admin(conn).create_topic("upgrade", REGION, 8)
            p = Producer(conn, "upgrade", deadline_s=30, client="old")
            for i in range(20):
                cols = make_pings("old", i * 300, 300, devices=40)
                p.send_batch(cols)
                acked += list(zip(cols.device_of().tolist(), cols.ts_ms.tolist()))
        (directory / "acked.json").write_text(json.dumps(acked))
    finally:
        lc.down(grace=1)
        lc.save()  # its processes stopped, its directories kept: the new code starts them
    """
)


def _old_tree(dest: Path) -> Path:
    """``BASELINE``'s files in ``dest``."""
    return exported_release(BASELINE, dest, own_stubs=False)


def test_a_cluster_written_before_the_log_store_is_taken_over_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _old_tree(tmp_path / "old")
    cluster = tmp_path / "cluster"
    subprocess.run(
        [sys.executable, "-c", OLD_SIDE, str(cluster), json.dumps(NODE_ARGS)],
        cwd=old, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(old)},
        check=True, timeout=300,
    )  # fmt: skip
    acked = [tuple(r) for r in json.loads((cluster / "acked.json").read_text())]
    lc = LocalCluster.load(cluster)
    for n in lc.nodes:  # the old layout: every data group's log in its own environment
        for g in (1, 2, 3):
            assert (Path(n.data_dir) / "groups" / str(g) / "raft" / "data.mdb").exists()
    lc.start_all()  # this tree's code
    try:
        lc.wait_ready(60)
        token = lc.admin_token
        assert token
        monkeypatch.setenv("ROADLOG_TOKEN", token)
        with Connection(lc.servers, tls=lc.tls()) as conn:
            p = Producer(conn, "upgrade", deadline_s=30, client="new")
            for i in range(5):
                cols = make_pings("new", i * 300, 300, devices=40)
                p.send_batch(cols)
                acked += list(zip(cols.device_of().tolist(), cols.ts_ms.tolist(), strict=True))
            assert_exactly_once_in_order(read_topic(conn, "upgrade"), acked)
        for n in lc.nodes:  # migrated: each group's log in its worker's store, once
            data = Path(n.data_dir)
            for g in (1, 2, 3):
                assert not (data / "groups" / str(g) / "raft" / "data.mdb").exists()
            held = [
                [g for g in (1, 2, 3) if store_holds(read_env(store_dir(data, w)), g)]
                for w in ("worker-0", "worker-1")
            ]
            assert held == [[1, 3], [2]]
    finally:
        lc.down(grace=1)
