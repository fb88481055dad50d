"""A rolling upgrade under load loses and duplicates nothing (issue 42).

A 3-node cluster of the product's default layout (one data group per
voter, in worker processes) and its queue server start from the previous
release's code (``BASELINE``, this repository's commit, its tree exported
into the test's directory with its own generated stubs). Producers
publish throughout, idempotent and plain. The nodes are upgraded one by
one to this tree's code (SIGTERM, started with the new code on the same
data directory, waited for until it serves and has applied what its
groups had committed when it came back); mid-way ``cluster status`` shows
the mixed cluster; then the queue server is upgraded too. Read back at
the end: no acknowledged ping lost, none of an idempotent producer stored
twice, every device's pings in order, and each Raft group's replicas
byte-identical on the three nodes.

It guards every change of the on-disk or wire format: the baseline is the
release a deployment upgrades from (move ``BASELINE`` on when a release
is cut).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import pytest

from node_daemon.state.replica_view import StateReplicaView
from roadlog.cli.cluster import mixed_releases
from roadlog.client import Admin, Connection, Producer
from roadlog.errors import RoadlogError
from roadlog.release import release
from roadlog.tools.localcluster import LocalCluster, NodeInfo, Proc
from tests.certs import ClusterCA
from tests.integration.conftest import REGION, make_pings, read_topic
from tests.integration.releases import exported_release
from tests.integration.test_replicated_log import digest
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

# The release upgraded from: the last landing before the log store's
# upgrade work (its data directories already in the log store's layout;
# test_log_store_upgrade.py covers the layout before that).
BASELINE = "52326cf"
TOPIC = "rolling"
PARTITIONS = 6
BATCH = 200
MAX_BATCHES = 5000  # per producer: a bound on the load whatever the machine's pace


def _old_tree(dest: Path) -> Path:
    """``BASELINE``'s files in ``dest``."""
    return exported_release(BASELINE, dest, own_stubs=True)


def _spawn_old(p: Proc, tree: Path) -> None:
    """Start ``p`` (a node or queue server of the cluster) on ``tree``'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with open(p.log, "ab") as log:
        proc = subprocess.Popen(
            p.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, cwd=str(tree), env=env,
        )  # fmt: skip
    p.pid = proc.pid


@dataclass
class Load:
    """A producer thread: batches until stopped (or MAX_BATCHES), what was
    acknowledged recorded; a failed batch is given up, never sent again."""

    conn: Connection
    name: str
    idempotent: bool
    acked: list[tuple[str, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Load:
        self.thread = threading.Thread(target=self._run, daemon=True, name=self.name)
        self.thread.start()
        return self

    def _run(self) -> None:
        p = Producer(self.conn, TOPIC, deadline_s=60, client=self.name, idempotent=self.idempotent)
        for i in range(MAX_BATCHES):
            if self.stop.is_set():
                break
            cols = make_pings(self.name, i * BATCH, BATCH, devices=8)
            try:
                p.send_batch(cols)
            except RoadlogError as e:
                self.errors.append(str(e))
                continue
            self.acked += list(zip(cols.device_of().tolist(), cols.ts_ms.tolist(), strict=True))
            self.stop.wait(0.02)

    def join(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), f"{self.name} did not stop"


def _acked(loads: list[Load]) -> int:
    return sum(len(x.acked) for x in loads)


def _wait_acks(loads: list[Load], more: int, what: str) -> None:
    start = _acked(loads)
    wait_for(lambda: _acked(loads) >= start + more, 90, what, every=0.2)


def _groups_of(status: dict[str, Any], node_id: int) -> dict[int, dict[str, Any]]:
    for n in status["nodes"]:
        if n["id"] == node_id:
            return {int(g["id"]): g for g in n.get("groups", ())}
    return {}


def _caught_up(lc: LocalCluster, node: NodeInfo) -> None:
    """Until ``node`` serves and has applied, in every group, what the
    group's leader had committed once it was back."""
    lc.wait_ready(120)
    st = lc.status()
    target = {}
    for g in _groups_of(st, node.id):
        leads = [
            _groups_of(st, n["id"]).get(g, {})
            for n in st["nodes"]
            if _groups_of(st, n["id"]).get(g, {}).get("role") == "leader"
        ]
        target[g] = max((v["commit_index"] for v in leads), default=0)
    assert target and all(target.values()), f"groups without a leader: {st}"

    def applied() -> bool:
        mine = _groups_of(lc.status(), node.id)
        return all(mine.get(g, {}).get("applied_index", 0) >= c for g, c in target.items())

    wait_for(applied, 120, f"{node.name} to apply what its groups committed", every=0.2)


def _leads_a_data_group(lc: LocalCluster, node: NodeInfo) -> Callable[[], bool]:
    def check() -> bool:
        groups = _groups_of(lc.status(), node.id)
        return any(g > 0 and v.get("role") == "leader" for g, v in groups.items())

    return check


def _mixed_is(lc: LocalCluster, want: dict[str, list[str]]) -> Callable[[], bool]:
    """``cluster status`` names ``want``'s releases (asked again: a node slow
    to answer is left out of one ask)."""
    return lambda: mixed_releases(lc.status()) == want


def _data_group_digest(node: NodeInfo, group: int) -> tuple[int, bytes] | None:
    """(applied index, state digest) of ``group``'s replica on ``node``, read
    as the node's main process reads a worker's group (read-only)."""
    try:
        state = Path(node.data_dir) / "groups" / str(group) / "state"
        sm = StateReplicaView(state, group).current()
    except (RoadlogError, lmdb.Error, OSError):
        return None
    try:
        return sm.indexed_digest()
    finally:
        sm.close()


def _replicas_identical(lc: LocalCluster, groups: list[int]) -> bool:
    for g in groups:
        if g == 0:
            seen = {digest(n.address) for n in lc.nodes}
        else:
            got = [_data_group_digest(n, g) for n in lc.nodes]
            if None in got:
                return False
            seen = set(got)  # type: ignore[arg-type]
        if len(seen) != 1:
            return False
    return True


def _build_info(lc: LocalCluster, p: NodeInfo | Any) -> str:
    with urllib.request.urlopen(lc.metrics_url(p), timeout=10) as r:
        text = r.read().decode()
    return next((line for line in text.splitlines() if line.startswith("roadlog_build_info")), "")


def test_a_rolling_upgrade_under_load_loses_and_duplicates_nothing(
    tmp_path: Path, test_ca: ClusterCA, monkeypatch: pytest.MonkeyPatch
) -> None:
    t0 = time.monotonic()
    old = _old_tree(tmp_path / "old")
    lc = LocalCluster.create(
        tmp_path / "cluster", 3, 1, data_groups=None, ca=(test_ca.ca_dir, test_ca.ca_key)
    )  # the product's default: one data group per voter, in worker processes
    loads: list[Load] = []
    try:
        for p in [*lc.queue_servers, *lc.nodes]:
            _spawn_old(p, old)
        lc.save()
        lc.wait_ready(120)
        assert lc.admin_token
        monkeypatch.setenv("ROADLOG_TOKEN", lc.admin_token)
        st = lc.status()
        assert {n.get("version", "") for n in st["nodes"]} == {""}  # the old release tells none
        groups = sorted({0, *lc.data_group_ids()})
        assert groups == [0, 1, 2, 3], st
        conn = Connection(lc.servers, tls=lc.tls())
        Admin(conn).create_topic(TOPIC, REGION, PARTITIONS)
        loads = [
            Load(conn, "idem-a", True).start(),
            Load(conn, "idem-b", True).start(),
            Load(conn, "plain", False).start(),
        ]
        _wait_acks(loads, 3 * BATCH, "the old release to take writes")
        phases = [f"old cluster up {time.monotonic() - t0:.0f} s"]
        for i, node in enumerate(lc.nodes):
            lc.restart(node.name, grace=20)  # SIGTERM; then this tree's code, same data
            _caught_up(lc, node)
            # Back as the leader of a data group (leaders spread again), its
            # followers older: the acks below need new-to-old traffic too.
            wait_for(_leads_a_data_group(lc, node), 90, f"{node.name} to lead a data group")
            assert _build_info(lc, node) == f'roadlog_build_info{{version="{release()}"}} 1.0'
            if i == 0:  # mid-upgrade: the operator sees both releases
                want = {"": ["n2", "n3", lc.servers[0]], release(): ["n1"]}
                wait_for(_mixed_is(lc, want), 30, f"cluster status to name {want}")
            _wait_acks(loads, 3 * BATCH, f"writes after {node.name}'s upgrade")
            phases.append(f"{node.name} upgraded {time.monotonic() - t0:.0f} s")
        lc.restart(lc.queue_servers[0].name, grace=20)  # the queue server last
        lc.wait_ready(120)
        _wait_acks(loads, 3 * BATCH, "writes through the upgraded queue server")
        wait_for(_mixed_is(lc, {}), 30, "one release again")
        for x in loads:
            x.join()
        for x in loads:
            assert x.acked, f"{x.name} had nothing acknowledged: {x.errors[:3]}"

        stored = read_topic(conn, TOPIC)
        counts: dict[tuple[str, int], int] = {}
        for rows in stored.values():
            last: dict[str, int] = {}
            for dev, ts in rows:
                counts[(dev, ts)] = counts.get((dev, ts), 0) + 1
                assert ts > last.get(dev, -1) or dev.startswith("plain"), f"{dev} out of order"
                last[dev] = ts
        for x in loads:
            lost = [r for r in x.acked if r not in counts]
            assert not lost, f"{x.name}: {len(lost)} acknowledged pings lost, e.g. {lost[:3]}"
            if x.idempotent:
                twice = [r for r, c in counts.items() if c > 1 and r[0].startswith(x.name)]
                assert not twice, f"{x.name}: {len(twice)} pings stored twice, e.g. {twice[:3]}"
        wait_for(
            lambda: _replicas_identical(lc, groups), 60, "every group's replicas identical", 0.5
        )
        conn.close()
        print(
            f"rolling upgrade from {BASELINE}: {_acked(loads)} pings acknowledged, "
            f"{sum(len(x.errors) for x in loads)} batches failed, {time.monotonic() - t0:.0f} s "
            f"({', '.join(phases)})"
        )
    finally:
        for x in loads:
            x.stop.set()
        lc.down(grace=1)
        shutil.rmtree(old, ignore_errors=True)
