"""Several Raft groups in one node process (multi-raft step 2,
docs/multiraft.md): a 3-node cluster with ``data_groups = 3`` runs group 0
and data groups 1..3 on every node, each electing and replicating on its
own over the same peer links; a SIGKILLed node takes all its groups down at
once, the others go on, and on restart it catches up in every group; the
data groups' leaders spread, one per node (step 4), and a restarted node
gets its group back. Pings still live in group 0 until publishes are
routed (step 3)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from node_daemon.storage.log_store import read_env, store_dir, store_holds
from roadlog.client import Connection, Producer
from roadlog.runtime.auth import cluster_token, token_metadata
from roadlog.runtime.processes import free_port
from roadlog.status import ask_node
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import admin_pb2, admin_pb2_grpc
from tests.integration.conftest import create_topic, make_pings, read_topic, wait_for

pytestmark = pytest.mark.integration

GROUPS = [0, 1, 2, 3]


def views(lc: LocalCluster) -> dict[int, dict[int, dict[str, Any]]]:
    """node id -> group id -> that node's view of the group (nodes that answer)."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for n in lc.nodes:
        v = ask_node(n.address, 2.0, lc.tls())
        if v is not None:
            out[n.id] = {g["id"]: g for g in v["groups"]}
    return out


def leaders(seen: dict[int, dict[int, dict[str, Any]]]) -> dict[int, int]:
    """group -> the node that leads it at the highest term any node reports."""
    out: dict[int, int] = {}
    for g in GROUPS:
        claims = [
            (v[g]["term"], nid) for nid, v in seen.items() if g in v and v[g]["role"] == "leader"
        ]
        if claims:
            out[g] = max(claims)[1]
    return out


def every_group_led_and_agreed(lc: LocalCluster, among: list[int]) -> bool:
    """Every group has one leader that each of ``among`` follows, and each of
    them has applied what it knows committed, in every group."""
    seen = views(lc)
    if sorted(seen) != sorted(among):
        return False
    lead = leaders(seen)
    return sorted(lead) == GROUPS and all(
        sorted(v) == GROUPS
        and all(
            v[g]["leader"] == lead[g] and v[g]["applied_index"] >= v[g]["commit_index"] > 0
            for g in GROUPS
        )
        for v in seen.values()
    )


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "2-workers"])
def test_data_groups_elect_replicate_and_survive_a_node_crash(
    make_cluster: Callable[..., LocalCluster], workers: int
) -> None:
    """Run with the data groups in the node's main process, and in two
    worker processes a node (multi-raft step 5): the same behaviour."""
    lc = make_cluster(
        nodes=3, extra=["--data-groups", "3", "--no-place-topics", "--workers", str(workers)]
    )
    ids = [n.id for n in lc.nodes]
    wait_for(lambda: every_group_led_and_agreed(lc, ids), 60, "every group led, everywhere")

    def spread() -> bool:  # data group g led by its preferred node: g (ids 1..3)
        return {g: lead for g, lead in leaders(views(lc)).items() if g} == {1: 1, 2: 2, 3: 3}

    wait_for(spread, 60, "the data groups' leaders spread over the nodes")
    for n in lc.nodes:  # each data group has its own state on every node, and its log
        for g in (1, 2, 3):  # in the log store the node's data groups share
            assert (Path(n.data_dir) / "groups" / str(g) / "state").is_dir()
            assert not (Path(n.data_dir) / "groups" / str(g) / "raft" / "data.mdb").exists()
        names = ["main"] if workers == 1 else ["worker-0", "worker-1"]
        held = []
        for name in names:  # worker w holds groups g with (g - 1) mod 2 == w
            env = read_env(store_dir(Path(n.data_dir), name))
            held.append([g for g in (1, 2, 3) if store_holds(env, g)])
        assert held == ([[1, 2, 3]] if workers == 1 else [[1, 3], [2]])

    # Each group's figures are on /metrics, labelled by group (a worker's
    # labelled with its worker too, asked of it by the scrape: a scrape may
    # still come before a new group's gauges are first set).
    def every_group_on_metrics() -> bool:
        with urllib.request.urlopen(
            lc.metrics_url(lc.nodes[0]), context=lc.ssl_context(), timeout=5
        ) as r:
            text = r.read().decode()
        return all(
            re.search(rf'^roadlog_raft_group_term\{{group="{g}"[,}}]', text, re.M) for g in GROUPS
        )

    wait_for(every_group_on_metrics, 15, "every group's term on the node's /metrics")

    # Writes go on as before (into group 0) and are read back.
    with Connection(lc.servers) as conn:
        create_topic(conn, "groups", partitions=4)
        Producer(conn, "groups").send_batch(make_pings("p", 0, 200))
        assert sum(len(v) for v in read_topic(conn, "groups").values()) == 200

    # The leader of group 1 goes down, with every group it runs.
    victim_id = leaders(views(lc))[1]
    victim = lc.node(victim_id)
    lc.kill(victim_id)
    others = [i for i in ids if i != victim_id]
    wait_for(lambda: every_group_led_and_agreed(lc, others), 60, "every group led by the others")
    assert victim_id not in leaders(views(lc)).values()

    # Back up, it catches up in every group: the same commit everywhere.
    lc.start(victim_id)
    wait_for(lambda: every_group_led_and_agreed(lc, ids), 60, "the restarted node in every group")

    def same_commit_everywhere() -> bool:
        seen = views(lc)
        return len(seen) == 3 and all(
            len({v[g]["applied_index"] for v in seen.values()}) == 1 for g in GROUPS
        )

    wait_for(same_commit_everywhere, 60, "every node applied the same in every group")
    # ... and gets its own data group back (after the hand-over interval).
    wait_for(spread, 60, "the restarted node leading its data group again")
    assert os.path.isdir(victim.data_dir)

    # A graceful stop hands every group the node leads to another voter
    # first (no group waits out an election timeout for it).
    log_before = Path(lc.node(2).log).read_text()
    lc.kill(2, signal.SIGTERM)
    handed = [  # (each worker process hands over its own groups)
        json.loads(line)
        for line in Path(lc.node(2).log).read_text()[len(log_before) :].splitlines()
        if "handed leadership over before stopping" in line
    ]
    to = {g: n for h in handed for g, n in h["groups"].items()}
    assert "2" in to, handed  # its data group, at least
    assert to["2"] in (1, 3)
    wait_for(lambda: every_group_led_and_agreed(lc, [1, 3]), 60, "every group led by 1 and 3")
    lc.start(2)
    wait_for(lambda: every_group_led_and_agreed(lc, ids), 60, "node 2 back in every group")

    # `roadlog-node transfer-leader` moves every group its leader leads, not
    # group 0 alone: group 0's leader also leads data groups here.
    wait_for(spread, 60, "node 2 leading its data group again")
    lead0 = leaders(views(lc))[0]
    r = subprocess.run(
        [sys.executable, "-m", "node_daemon.process.main", "transfer-leader",
         "--address", lc.node(lead0).address, "--secret-file", lc.secret_file,
         "--certs-dir", lc.node(lead0).certs_dir],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    moved = json.loads(r.stdout)
    assert moved["from"] == lead0 and "still_leads" not in moved, moved

    # Membership: a node added to group 0 joins every data group (as a
    # learner, as in group 0), and leaves every one when removed.
    def members(kind: str) -> dict[int, set[int]]:
        seen = views(lc)
        lead = leaders(seen)
        return {g: set(seen[lead[g]][g][kind]) for g in GROUPS if lead.get(g) in seen}

    def admin(method: str, request: Any) -> None:
        lead = leaders(views(lc))[0]
        token = cluster_token(Path(lc.secret_file).read_bytes().strip(), "roadlog")
        with lc.tls().channel(lc.node(lead).address) as ch:
            getattr(admin_pb2_grpc.AdminStub(ch), method)(
                request, metadata=token_metadata(token), timeout=30
            )

    add = admin_pb2.AddNodeRequest(node_id=4, address=f"127.0.0.1:{free_port()}")
    admin("AddNode", add)
    wait_for(
        lambda: (
            all(4 in ls for ls in members("learners").values()) and len(members("learners")) == 4
        ),
        60,
        "node 4 a learner of every group",
    )
    admin("RemoveNode", admin_pb2.RemoveNodeRequest(node_id=4))
    wait_for(
        lambda: len(members("learners")) == 4 and not any(members("learners").values()),
        60,
        "node 4 gone from every group",
    )
    assert all(v == {1, 2, 3} for v in members("voters").values())

    # `cluster status --json` tells every group, with its leader and term.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "roadlog.cli",
            "cluster",
            "status",
            "--json",
            "--cluster",
            str(lc.dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    groups = {g["id"]: g for g in json.loads(r.stdout)["groups"]}
    assert sorted(groups) == GROUPS
    assert all(groups[g]["leader"] in ids and groups[g]["term"] >= 1 for g in GROUPS)
    assert groups[0]["partitions"] and not any(groups[g]["partitions"] for g in (1, 2, 3))
