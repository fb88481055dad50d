"""Worker processes (multi-raft step 5, docs/multiraft.md): a 3-node cluster
with 4 data groups and ``workers = 2`` runs group 0 in each node's main
process and the data groups in two worker processes per node (group g in
worker (g-1) mod 2). Publishes go to the data groups' leaders in the
workers and are read back through the main processes; a SIGKILLed worker
is started again by its main process and catches up while its groups
elect elsewhere; a whole-cluster SIGKILL (workers die with their main
process) loses nothing acknowledged."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.cpu import spawned_children as children  # a node's worker processes
from node_daemon.process.zygote import ZYGOTE_NAME
from roadlog.client import Admin, Connection, Producer
from roadlog.runtime.processes import alive
from roadlog.tools.localcluster import LocalCluster
from tests.integration.conftest import (
    assert_exactly_once_in_order,
    create_topic,
    make_pings,
    read_topic,
    wait_for,
)
from tests.integration.test_raft_groups import views

pytestmark = pytest.mark.integration

GROUPS = [0, 1, 2, 3, 4]
WORKERS = ["--data-groups", "4", "--place-topics", "--workers", "2"]


def workers_in_metrics(lc: LocalCluster, node: Any) -> dict[int, str]:
    """Data group -> the worker whose commit index the node's /metrics shows."""
    with urllib.request.urlopen(lc.metrics_url(node), context=lc.ssl_context(), timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "roadlog_raft_group_commit_index" and "worker" in s.labels:
                out[int(s.labels["group"])] = s.labels["worker"]
    return out


def zygotes(pid: int) -> list[int]:
    """The node's zygote (``node_daemon.process.zygote``), if it runs."""
    out = []
    for kid in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        with contextlib.suppress(OSError), open(f"/proc/{kid}/stat") as f:
            name, state = f.read().rsplit(")", 1)
            if name.split("(", 1)[1] == ZYGOTE_NAME and state.split()[0] not in ("Z", "X"):
                out.append(int(kid))
    return out


def started_how(node: Any) -> list[str]:
    """How each of the node's worker processes was started, in its log's
    order ("forked" by its zygote, or "spawned")."""
    out = []
    for line in Path(node.log).read_text(errors="replace").splitlines():
        if '"worker process started"' in line:
            out.append(json.loads(line).get("how", "?"))
    return out


def all_led(lc: LocalCluster, among: list[int]) -> bool:
    """Every group led, each of ``among`` following that leader and applied
    what it knows committed, in every group."""
    seen = views(lc)
    if sorted(seen) != sorted(among):
        return False
    lead: dict[int, Any] = {}
    for g in GROUPS:
        claims = [(v[g]["term"], n) for n, v in seen.items() if g in v and v[g]["role"] == "leader"]
        if not claims:
            return False
        lead[g] = max(claims)[1]
    return all(
        all(
            g in v
            and v[g]["leader"] == lead[g]
            and v[g]["applied_index"] >= v[g]["commit_index"] > 0
            for g in GROUPS
        )
        for v in seen.values()
    )


def rows(cols: Any) -> list[tuple[str, int]]:
    return list(zip(cols.device_of().tolist(), cols.ts_ms.tolist(), strict=True))


def test_data_groups_in_worker_processes_through_a_worker_crash_and_a_cluster_crash(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    lc = make_cluster(nodes=3, extra=WORKERS)
    ids = [n.id for n in lc.nodes]
    wait_for(lambda: all_led(lc, ids), 90, "every group led, everywhere")
    for n in lc.nodes:
        assert len(children(n.pid)) == 2, f"node {n.id}'s worker processes"
    # One /metrics for the node: its workers' groups there, labelled by worker
    # (sent every 2 s); /readyz says the workers are alive.
    wait_for(lambda: workers_in_metrics(lc, lc.nodes[0]) == {1: "0", 2: "1", 3: "0", 4: "1"}, 20,
             "each group's figures from its worker")  # fmt: skip
    with urllib.request.urlopen(
        lc.metrics_url(lc.nodes[0]).replace("/metrics", "/readyz"), context=lc.ssl_context()
    ) as r:
        assert json.loads(r.read())["workers_alive"] is True
    acked: list[tuple[str, int]] = []
    with Connection(lc.servers) as conn:
        create_topic(conn, "munich", partitions=8)
        d = Admin(conn).describe("munich")
        assert sorted({p.group for p in d.partitions}) == [1, 2, 3, 4]
        producer = Producer(conn, "munich")
        for i in range(5):
            batch = make_pings("van", i * 400, 400, devices=32)
            assert producer.send_batch(batch).count == 400
            acked += rows(batch)
        assert_exactly_once_in_order(read_topic(conn, "munich"), acked)

        # A worker process dies: its main process starts it again; writes
        # go on meanwhile (its groups elect leaders on the other nodes).
        node = lc.nodes[0]
        victim = children(node.pid)[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not alive(victim), 10, "the worker gone")
        for i in range(5, 10):
            batch = make_pings("van", i * 400, 400, devices=32)
            assert producer.send_batch(batch).count == 400
            acked += rows(batch)
        wait_for(
            lambda: len(children(node.pid)) == 2 and victim not in children(node.pid),
            30,
            "the worker started again",
        )
        wait_for(lambda: all_led(lc, ids), 90, "every group led and caught up again")
        assert_exactly_once_in_order(read_topic(conn, "munich"), acked)
        assert started_how(node) == ["forked"] * 3  # by its zygote, the restart too

        # Its zygote gone, a worker that dies is spawned instead (logged):
        # a child of its node all the same, found as a worker.
        (zyg,) = zygotes(node.pid)
        os.kill(zyg, signal.SIGKILL)
        victim = children(node.pid)[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: len(children(node.pid)) == 2 and victim not in children(node.pid),
            60,
            "the worker spawned again",
        )
        assert started_how(node)[-1] == "spawned"
        assert zygotes(node.pid) == []  # reaped
        wait_for(lambda: all_led(lc, ids), 90, "every group led and caught up again")
        batch = make_pings("van", 4000, 400, devices=32)
        assert producer.send_batch(batch).count == 400
        acked += rows(batch)
        assert_exactly_once_in_order(read_topic(conn, "munich"), acked)

    # The whole cluster crashes: main processes SIGKILLed, their workers die
    # with them; everything acknowledged is there after the restart.
    workers = [w for n in lc.nodes for w in children(n.pid)]
    for n in lc.nodes:
        lc.kill(n.id)
    wait_for(lambda: not any(alive(w) for w in workers), 10, "the workers gone with their nodes")
    for n in lc.nodes:
        lc.start(n.id)
    lc.wait_ready(90)
    wait_for(lambda: all_led(lc, ids), 90, "every group led after the restart")
    with Connection(lc.servers) as conn:
        producer = Producer(conn, "munich")
        batch = make_pings("car", 0, 400, devices=32)
        assert producer.send_batch(batch).count == 400
        acked += rows(batch)
        assert_exactly_once_in_order(read_topic(conn, "munich"), acked)
