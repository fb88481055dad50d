"""A node restarted with another number of worker processes (the
``workers`` key: a resized VM, issue 42) moves each data group's log to
the log store of the process that now runs it, at start, and loses
nothing: 3 data groups on 2 workers, then two of the three nodes (a
majority of every group: a move that lost a log would lose acknowledged
pings) restarted in turn with 1 (every group in the main process:
``logs/main``), then with 4 (capped at the 3 groups: one each), pings
published after every restart and all of them read back once, in order;
each group's log is in exactly one store of each node, the one its
process runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from node_daemon.storage.log_store import read_env, store_dir, store_holds, stores_in
from roadlog.client import Admin, Connection, Producer
from roadlog.tools.localcluster import LocalCluster, NodeInfo
from tests.integration.conftest import (
    REGION,
    assert_exactly_once_in_order,
    make_pings,
    read_topic,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

GROUPS = (1, 2, 3)
# workers -> the stores that hold each group's log (groups go round the workers)
LAYOUTS = {
    2: {"worker-0": [1, 3], "worker-1": [2]},
    1: {"main": [1, 2, 3]},
    4: {"worker-0": [1], "worker-1": [2], "worker-2": [3]},  # capped at the groups
}


def _holdings(node: NodeInfo) -> dict[str, list[int]]:
    """Each log store of ``node`` with the groups whose log it holds whole."""
    data = Path(node.data_dir)
    out = {}
    for path in stores_in(data / "logs"):
        held = [g for g in GROUPS if store_holds(read_env(store_dir(data, path.name)), g)]
        if held:
            out[path.name] = held
    return out


def _with_workers(node: NodeInfo, workers: int) -> None:
    argv = node.argv
    argv[argv.index("--workers") + 1] = str(workers)


def _caught_up(lc: LocalCluster, node: NodeInfo) -> Callable[[], bool]:
    def check() -> bool:
        st = lc.status()
        views = {n["id"]: {g["id"]: g for g in n.get("groups", ())} for n in st["nodes"]}
        mine = views.get(node.id, {})
        for g in GROUPS:
            commits = [v[g]["commit_index"] for v in views.values() if g in v]
            if g not in mine or mine[g]["applied_index"] < max(commits, default=1):
                return False
        return True

    return check


def test_a_node_restarted_with_another_number_of_workers_moves_each_groups_log(
    make_cluster: Any,
) -> None:
    lc = make_cluster(nodes=3, extra=["--data-groups", "3", "--place-topics", "--workers", "2"])
    acked: list[tuple[str, int]] = []
    with Connection(lc.servers, tls=lc.tls()) as conn:
        Admin(conn).create_topic("resize", REGION, 6)
        p = Producer(conn, "resize", deadline_s=60, client="resize")

        def publish() -> None:
            for _ in range(5):
                cols = make_pings("resize", len(acked), 300, devices=30)
                p.send_batch(cols)
                acked.extend(zip(cols.device_of().tolist(), cols.ts_ms.tolist(), strict=True))

        publish()
        for n in lc.nodes:
            assert _holdings(n) == LAYOUTS[2], n.name
        for workers in (1, 4):
            for n in lc.nodes[:2]:  # one node at a time, as VMs are resized
                _with_workers(n, workers)
                lc.restart(n.name, grace=20)
                lc.wait_ready(120)
                wait_for(_caught_up(lc, n), 120, f"{n.name} caught up on {workers} workers", 0.2)
                assert _holdings(n) == LAYOUTS[workers], (n.name, _holdings(n))
                publish()
        assert_exactly_once_in_order(read_topic(conn, "resize"), acked)
