"""Heat-map retention on a live cluster: the leader's periodic trim (every
``trim_interval_s``, through the log) deletes a topic's heat maps whose
window ended before its retention, but keeps its newest windows
(HEATMAP_KEEP_NEWEST), on every node alike."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from node_daemon.state.heatmaps import HEATMAP_KEEP_NEWEST
from roadlog.client import Admin, Connection, Producer
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import heatmaps_pb2
from tests.integration.conftest import REGION, make_pings, wait_for
from tests.integration.test_replicated_log import digest

pytestmark = pytest.mark.integration

WINDOW_MS = 60_000
RETENTION_MS = 3_600_000  # an hour


def _heatmap(start_ms: int) -> heatmaps_pb2.HeatMap:
    return heatmaps_pb2.HeatMap(
        topic="old-maps",
        window_start_ms=start_ms,
        window_end_ms=start_ms + WINDOW_MS,
        h3_resolution=9,
        cells=heatmaps_pb2.HeatMapCells(
            h3=[0x891F8D7A49BFFFF], pings=[1], devices=[1], mean_speed_mps=[3.0]
        ),
    )


def test_the_leaders_trim_deletes_old_heat_maps_but_the_newest(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    lc = make_cluster(3, extra=["--trim-interval-s", "1"])
    with Connection(lc.servers, timeout=30) as conn:
        admin = Admin(conn)
        # Retention, not give-to-get's minimum, is what this looks at.
        admin.create_topic("old-maps", REGION, 1, retention_ms=RETENTION_MS,
                           contribution_min_pings=1, contribution_min_seconds=0)  # fmt: skip
        Producer(conn, "old-maps", client="alice").send_batch(make_pings("alice", 0, 5))
        now = int(time.time() * 1000)
        # Windows that ended two days ago, minute after minute: all past the
        # retention, more than are always kept.
        first = now - 2 * 86_400_000
        starts = [first + i * WINDOW_MS for i in range(HEATMAP_KEEP_NEWEST + 20)]
        for start in starts:
            admin.put_heatmap(_heatmap(start))
        newest = starts[-HEATMAP_KEEP_NEWEST:]

        def kept() -> list[int]:  # reads wait for the puts (the connection's fence)
            return sorted(admin.heatmap("old-maps", client="alice").windows)

        assert set(newest) <= set(kept()) <= set(starts)  # a trim keeps the newest, whenever it ran
        wait_for(lambda: kept() == newest, 60, "the trim to keep only the newest windows")
        after = admin.heatmap("old-maps", client="alice")
        assert sorted(after.windows) == newest and len(after.windows) == HEATMAP_KEEP_NEWEST
        assert after.heatmap.window_start_ms == starts[-1]  # the latest map is still served
        # Every node holds the same: the state digests agree.
        wait_for(lambda: len({digest(n.address) for n in lc.nodes}) == 1, 30, "equal replicas")
        assert len({digest(n.address) for n in lc.nodes}) == 1
