"""The default number of data groups (issue 18: one per voter), on real
node processes: decided at a node's first start and kept in its data
directory, and a node that decided another number than the cluster was
founded with takes the cluster's (it records it and stops as failed, for
systemd to start it again) and then runs every group."""

from __future__ import annotations

from pathlib import Path

import pytest

from roadlog.client import Admin, Connection
from roadlog.placement import DATA_GROUPS_RECORD
from roadlog.runtime.processes import alive
from roadlog.tools.localcluster import LocalCluster
from tests.certs import ClusterCA
from tests.integration.conftest import REGION, wait_for

pytestmark = pytest.mark.integration


def groups_of(lc: LocalCluster, node_id: int) -> set[int]:
    """The Raft groups node ``node_id`` says it runs (empty: it did not answer)."""
    for n in lc.status()["nodes"]:
        if n["id"] == node_id and n.get("groups"):
            return {int(g["id"]) for g in n["groups"]}
    return set()


def test_a_node_that_decided_other_data_groups_takes_the_founded_ones(
    tmp_path: Path, test_ca: ClusterCA, monkeypatch: pytest.MonkeyPatch
) -> None:
    lc = LocalCluster.create(
        tmp_path / "c", 3, 1, ca=(test_ca.ca_dir, test_ca.ca_key), data_groups=None
    )
    # Node 3 starts from a data directory that decided 2 groups (as a node
    # configured with other voters would); nodes 1 and 2 decide 3, one per voter.
    record3 = Path(lc.node(3).data_dir) / DATA_GROUPS_RECORD
    record3.parent.mkdir(parents=True)
    record3.write_text("2\n")
    try:
        lc.start_all()
        lc.wait_ready(60)
        assert lc.admin_token
        monkeypatch.setenv("ROADLOG_TOKEN", lc.admin_token)
        for n in (1, 2):
            assert (Path(lc.node(n).data_dir) / DATA_GROUPS_RECORD).read_text() == "3\n"
        wait_for(lambda: groups_of(lc, 3) == {0, 1, 2}, 30, "node 3 running 2 data groups")

        # The first topic records the cluster's number (its leader's: 3, or
        # 2 if node 3 led group 0), and places its partitions by it. Nodes 1
        # and 2 decided 3; whichever number was recorded, a node that runs
        # another takes it.
        with Connection(lc.servers) as conn:
            topic = Admin(conn).create_topic("munich", REGION, 4)
        founded = max(p.group for p in topic.partitions)
        assert founded in (2, 3)
        odd = [n for n in (1, 2, 3) if (2 if n == 3 else 3) != founded]
        assert odd  # node 3, or nodes 1 and 2: someone always has to change
        for n in odd:
            pid = lc.node(n).pid

            def stopped(pid: int = pid) -> bool:
                return not alive(pid)

            wait_for(stopped, 30, f"node {n} stopping to take the cluster's groups")
            record = Path(lc.node(n).data_dir) / DATA_GROUPS_RECORD
            assert record.read_text() == f"{founded}\n"
            assert "founded with other data groups" in Path(lc.node(n).log).read_text()
            lc.start(n)  # what systemd does (Restart=on-failure)
        everyone = set(range(founded + 1))
        wait_for(
            lambda: all(groups_of(lc, n) == everyone for n in (1, 2, 3)),
            60,
            "every node running the founded data groups",
        )
        assert all(alive(lc.node(n).pid) for n in (1, 2, 3))
    finally:
        lc.down(grace=1)
