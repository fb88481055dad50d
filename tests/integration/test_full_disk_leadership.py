"""A nearly full disk on the default cluster (3 nodes, one data group per
node in worker processes, leaders spread): the node whose disk is low
refuses growing writes, and so hands every group it leads (group 0 and its
data group) to a voter with room (node_daemon/store/leader_balance.py,
told of its peers' disks by the bit on every batch they send:
node_daemon/transport/peer_disk.py). Writes to every partition are taken
again once its groups moved; none is handed back to it while it is low;
once there is room again its data group goes back to it (leaders spread).
Nothing acknowledged is lost on the way."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_daemon.store.leader_balance import MIN_INTERVAL_S, ROUND_S
from roadlog.client import Connection, Producer, RoadlogError
from roadlog.runtime.processes import alive
from roadlog.tools.localcluster import LocalCluster, NodeInfo
from tests.certs import ClusterCA
from tests.integration.conftest import (
    assert_exactly_once_in_order,
    create_topic,
    make_pings,
    read_topic,
    wait_for,
)
from tests.integration.test_full_disk import MIN_FREE, ballast, on_small_disks
from tests.integration.test_raft_groups import GROUPS, leaders, views

pytestmark = pytest.mark.integration

PARTITIONS = 6  # two in each data group
DATA_GROUPS = [g for g in GROUPS if g]


@pytest.fixture
def default_cluster_on_small_disks(
    tmp_path: Path, test_ca: ClusterCA, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LocalCluster]:
    # The product's layout: a data group per voter, in worker processes.
    with on_small_disks(tmp_path / "c", test_ca, monkeypatch, data_groups=None) as lc:
        yield lc


def spread(lc: LocalCluster) -> dict[int, int] | None:
    """group -> leader, once group 0 is led and data group g by node g (its
    preferred leader: the leaders spread); None before."""
    lead = leaders(views(lc))
    if sorted(lead) != GROUPS or any(lead[g] != g for g in DATA_GROUPS):
        return None
    return lead


def disk_handovers(lc: LocalCluster, node: NodeInfo) -> float:
    """Groups the node handed off for its low disk (its /metrics, workers'
    included)."""
    with urllib.request.urlopen(lc.metrics_url(node), context=lc.ssl_context(), timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("roadlog_raft_group_leader_disk_handovers_total{")
    )


def test_a_node_whose_disk_is_low_hands_its_groups_to_the_nodes_with_room(
    default_cluster_on_small_disks: LocalCluster,
) -> None:
    lc = default_cluster_on_small_disks
    wait_for(lambda: spread(lc) is not None, 120, "every group led, data group g by node g")
    with Connection(lc.servers, timeout=10) as conn:
        create_topic(conn, partitions=PARTITIONS)
        producer = Producer(conn, "munich", client="p", deadline_s=5)
        acked: list[tuple[str, int]] = []
        sent = 0

        def publish() -> bool:
            """One batch with pings in every partition, taken whole."""
            nonlocal sent
            cols = make_pings("p", sent, 600, devices=60)
            sent += len(cols)  # a batch refused is never sent again
            try:
                ack = producer.send_batch(cols)
            except RoadlogError:
                return False
            acked.extend(zip(cols.device_of().tolist(), cols.ts_ms.tolist(), strict=True))
            assert {p for p, _, _ in ack.offsets} == set(range(PARTITIONS)), ack.offsets
            return True

        wait_for(publish, 60, "a first write to every partition")

        # The node that leads group 0 (and its own data group) runs low.
        lead = spread(lc)
        assert lead is not None
        full = lc.node(lead[0])
        led_by_full = [g for g, n in lead.items() if n == full.id]
        assert led_by_full == sorted({0, full.id})
        weight = ballast(full, MIN_FREE // 2)

        def moved_and_taken() -> bool:
            now = leaders(views(lc))
            return (
                sorted(now) == GROUPS and full.id not in now.values() and publish()  # every one
            )

        wait_for(moved_and_taken, 60, "the low node's groups moved, writes taken again")
        wait_for(
            lambda: disk_handovers(lc, full) >= len(led_by_full),
            30,
            "the low node's hand-overs counted",
        )

        # Not handed back while it is low: watched over more than the
        # balancer's interval (a hand-back would lead there a whole interval).
        watch_until = time.monotonic() + MIN_INTERVAL_S + 3 * ROUND_S

        def still_elsewhere() -> bool:
            now = leaders(views(lc))
            assert full.id not in now.values(), f"node {full.id}, low, leads again: {now}"
            return time.monotonic() > watch_until and publish()

        wait_for(still_elsewhere, MIN_INTERVAL_S + 60, "the low node kept off its groups")
        assert all(alive(n.pid) for n in lc.nodes)

        # Room again: its data group goes back to it, writes go on.
        weight.unlink()
        wait_for(lambda: spread(lc) is not None, 60, "data group g back at node g")
        wait_for(publish, 30, "a write to every partition after")

        stored = read_topic(conn, "munich")
        assert_exactly_once_in_order(stored, acked)  # nothing acknowledged lost
