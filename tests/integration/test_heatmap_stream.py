"""The streaming heat map against a real cluster: a streamed window is the
batch build of the same window (same cells, same figures), a restart from
the checkpoint neither loses nor doubles a ping (a micro-batch run again
after a crash included), and pings later than the lateness are counted.

Few pings on purpose (under a thousand): Spark's percentile_approx is exact
below that, so the free-flow speeds and congestion of both builds agree to
the float, whatever Spark's partitioning of the rows."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pyspark.sql import SparkSession

from roadlog.client import Admin, Connection, Producer
from roadlog.columnar import PingColumns
from roadlog.geo import bbox_region, parse_region
from roadlog.tools.localcluster import LocalCluster
from roadlog.tools.traffic import TrafficSpec, simulate
from roadlog.v1 import heatmaps_pb2
from spark.jobs.heatmap import run, session
from spark.jobs.heatmap_stream import Windows, start
from tests.certs import ClusterCA
from tests.integration.conftest import wait_for
from tests.integration.test_replicated_log import digest

pytestmark = pytest.mark.integration

REGION = bbox_region(11.45, 48.08, 11.70, 48.20)
HOT = (11.575, 48.137)
MIN = 60_000


ALICE: list[str] = []  # the token of alice, who sends the pings and asks for the maps


def as_alice(lc: LocalCluster) -> Connection:
    return Connection(lc.servers, tls=lc.tls().with_token(ALICE[-1]))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, test_ca: ClusterCA) -> Iterator[LocalCluster]:
    lc = LocalCluster.create(Path(tmp_path_factory.mktemp("hs")) / "c", 3, 1, ca=test_ca.signing)
    lc.start_all()
    try:
        lc.wait_ready(60)
        with Connection(lc.servers, tls=lc.tls()) as conn:
            # The stream, not give-to-get's minimum, is what this looks at:
            # alice's batches, sent at once, count (one ping would).
            Admin(conn).create_topic("munich", REGION.geojson, 4, contribution_min_pings=1,
                                     contribution_min_seconds=0)  # fmt: skip
            ALICE.append(
                Admin(conn).create_client("alice", ["produce:munich", "heatmap:munich"]).token
            )
        yield lc
    finally:
        lc.down(grace=1)


def publish(lc: LocalCluster, batches: list[PingColumns]) -> int:
    """Publish as alice; wait until every node applied it (the source plans
    on one node, at what it applied); how many pings."""
    n = 0
    with as_alice(lc) as conn:
        p = Producer(conn, "munich")
        for cols in batches:
            p.send_batch(cols)
            n += len(cols)
        written = conn.fence
    wait_for(lambda: all(int(digest(nd.address)[0]) >= written for nd in lc.nodes), 30,
             "every node to apply the published pings")  # fmt: skip
    return n


def traffic(end_ms: int, seed: int, vehicles: int = 10, seconds: int = 40) -> list[PingColumns]:
    spec = TrafficSpec(vehicles=vehicles, duration_s=seconds, end_ms=end_ms, hotspots=(HOT,),
                       seed=seed)  # fmt: skip
    return list(simulate(parse_region(REGION.geojson), spec))


def stream_once(
    spark: SparkSession, lc: LocalCluster, checkpoint: Path, now_ms: int
) -> list[dict[str, Any]]:
    """One run of the stream (Trigger.AvailableNow) at a fixed clock, as a
    restarted process would (a new query from the checkpoint); its
    micro-batches' reports."""
    reports: list[dict[str, Any]] = []
    query = start(
        spark,
        topic="munich",
        nodes=[n.address for n in lc.nodes],
        servers=lc.servers,
        secret_file=None,  # with TLS the reader's client certificate is its credential
        cluster_name="roadlog",
        checkpoint=checkpoint,
        windows=Windows(MIN, 15 * MIN, 0),
        history_ms=3_600_000,
        once=True,
        report=reports.append,
        clock=lambda: now_ms / 1000,
    )
    query.awaitTermination(240)
    assert query.exception() is None
    assert not query.isActive
    return reports


def stored(lc: LocalCluster, start: int, fence: int) -> heatmaps_pb2.HeatMap:
    with as_alice(lc) as conn:
        conn.fence = fence
        return Admin(conn).heatmap("munich", window_start_ms=start).heatmap


def figures(hm: heatmaps_pb2.HeatMap) -> dict[int, tuple[Any, ...]]:
    c = hm.cells
    return {
        c.h3[i]: (c.pings[i], c.devices[i], c.mean_speed_mps[i], c.free_flow_mps[i],
                  c.congestion[i])
        for i in range(len(c.h3))
    }  # fmt: skip


def same(a: dict[int, tuple[Any, ...]], b: dict[int, tuple[Any, ...]]) -> None:
    assert a.keys() == b.keys()
    for h, fa in a.items():
        fb = b[h]
        assert fa[:2] == fb[:2], h
        for x, y in zip(fa[2:], fb[2:], strict=True):
            assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-6), h


@pytest.fixture
def spark() -> Iterator[SparkSession]:
    """One session for the stream's runs and the batch job (which stops it)."""
    s = session("local[2]", app="roadlog-heatmap-stream-test")
    try:
        yield s
    finally:
        s.stop()


def test_a_streamed_window_is_the_batch_build_across_restarts_and_replays(
    cluster: LocalCluster, spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lc = cluster
    assert lc.spark_token
    monkeypatch.setenv("ROADLOG_TOKEN", lc.spark_token)  # the jobs' identity, as the CLI sets it
    now = int(time.time() * 1000)
    end = now // MIN * MIN  # the window a trigger now computes
    start = end - 15 * MIN
    checkpoint = tmp_path / "checkpoint"

    first = traffic(end - 30_000, seed=1)
    n1 = publish(lc, first)
    (r1,) = stream_once(spark, lc, checkpoint, now)
    assert r1["batch"] == 0 and r1["end"] == end and r1["windows"] == [[start, end]]
    assert r1["new_pings"] == n1 and r1["pings"] == n1 and r1["too_late"] == 0

    # More traffic, and pings older than any open window (lateness 0: the
    # window is [end - 15 min, end)): counted, not in the window.
    second = traffic(end - 5_000, seed=2, vehicles=8)
    old = traffic(end - 20 * MIN, seed=3, vehicles=2, seconds=10)
    n2, n_old = publish(lc, second), publish(lc, old)
    (r2,) = stream_once(spark, lc, checkpoint, now)  # a restart from the checkpoint
    assert r2["batch"] == 1 and r2["new_pings"] == n2 + n_old
    assert r2["too_late"] == n_old
    assert r2["pings"] == n1 + n2  # nothing lost, nothing counted twice
    streamed = stored(lc, start, r2["applied_index"])
    assert streamed.source_pings == n1 + n2 and len(streamed.cells.h3) > 10

    # The query stops after batch 1 ran but before Spark recorded it: the
    # restart runs batch 1 again, and the window is the same, not doubled.
    for name in ("1", ".1.crc"):  # Spark's commit record of batch 1 and its checksum
        (checkpoint / "spark" / "commits" / name).unlink()
    replay = stream_once(spark, lc, checkpoint, now + 10 * MIN)  # its record keeps its end
    assert replay[0]["batch"] == 1 and replay[0]["end"] == end
    assert replay[0]["pings"] == n1 + n2
    # (a batch 2 follows when the clock's minute turned since: no pings, a later window)
    assert all(r["new_pings"] == 0 for r in replay[1:])
    same(figures(stored(lc, start, replay[0]["applied_index"])), figures(streamed))

    # The batch job over the same window: the same cells and figures.
    summary = run(
        topic="munich",
        nodes=[n.address for n in lc.nodes],
        servers=lc.servers,
        secret_file=None,  # with TLS the reader's client certificate is its credential
        cluster_name="roadlog",
        window_start_ms=start,
        window_end_ms=end,
        history_ms=3_600_000,
        out_dir=tmp_path / "out",
    )
    built = stored(lc, start, int(str(summary["applied_index"])))
    assert built.source_pings == streamed.source_pings
    same(figures(streamed), figures(built))
    assert np.isfinite(np.array(built.cells.congestion)).all()
