"""The Spark data source over a topic placed in data groups (issue 18):
each partition's pings live in its own group's state machine on every
node, so a plan's ranges name their group and are fenced by that group's
applied index; batch and streaming reads give every acknowledged ping of
the window once, the same twice, and the heat-map job counts them all."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

from roadlog.client import Admin, Connection, Producer
from roadlog.geo import bbox_region, parse_region
from roadlog.status import ask_node
from roadlog.tools.localcluster import LocalCluster
from roadlog.tools.traffic import TrafficSpec, simulate
from spark.jobs.heatmap import run
from spark.roadlog_source import RoadlogStreamReader, plan, read_range
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration

REGION = bbox_region(11.45, 48.08, 11.70, 48.20)
HOT = (11.575, 48.137)


def _applied_everywhere(lc: LocalCluster, fences: dict[int, int]) -> bool:
    """Every node applied each group's fence."""
    for n in lc.nodes:
        v = ask_node(n.address, 2.0, lc.tls())
        if v is None:
            return False
        applied = {g["id"]: g["applied_index"] for g in v["groups"]}
        if any(applied.get(g, 0) < i for g, i in fences.items()):
            return False
    return True


def _rows(tasks: list[Any]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for t in tasks:
        for rb in read_range(t):
            out += zip(rb.column("partition").to_pylist(), rb.column("offset").to_pylist(),
                       strict=True)  # fmt: skip
    return out


def test_spark_reads_a_topic_placed_in_data_groups(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    lc = make_cluster(nodes=3, extra=["--data-groups", "3", "--place-topics"])
    end = int(time.time() * 1000)
    with Connection(lc.servers, timeout=30) as conn:
        Admin(conn).create_topic("munich", REGION.geojson, 6)
        topic = Admin(conn).describe("munich").topic
        assert sorted(set(topic.partition_groups)) == [1, 2, 3]
        spec = TrafficSpec(vehicles=60, duration_s=120, end_ms=end, hotspots=(HOT,), seed=7)
        producer = Producer(conn, "munich")
        sent = 0
        for cols in simulate(parse_region(REGION.geojson), spec):
            producer.send_batch(cols)
            sent += len(cols)
        fences = {0: conn.fence, **conn.group_fences}
    assert set(fences) >= {1, 2, 3}
    # A plan is pinned at the applied indexes of the node that answers it,
    # and takes no fence: wait until every node has applied everything.
    wait_for(lambda: _applied_everywhere(lc, fences), 30, "every node applied every group")

    options = {
        "nodes": ",".join(n.address for n in lc.nodes),
        "topic": "munich",
        "window_start_ms": str(end - 120_000 - 1000),
        "window_end_ms": str(end + 1),
        "max_pings_per_task": "1500",
    }
    tasks = plan(options)
    assert {t.group for t in tasks} == {1, 2, 3}
    assert all(t.fence >= 1 for t in tasks)
    first = _rows(tasks)
    assert len(first) == sent == len(set(first))
    assert _rows(tasks) == first  # pinned: the same twice

    # Streaming: from the earliest offsets to everything available.
    stream = RoadlogStreamReader({"nodes": options["nodes"], "topic": "munich",
                                  "starting": "earliest"})  # fmt: skip
    start = stream.initialOffset()
    latest = stream.latestOffset(start, ReadAllAvailable())
    assert set(latest["fences"]) == {"1", "2", "3"}
    parts = stream.partitions(start, latest)
    assert len(_rows([t for p in parts for t in p.value])) == sent  # a task: ranges
    assert stream.latestOffset(latest, ReadAllAvailable())["partitions"] == latest["partitions"]

    # The heat-map job (Spark, local) counts every ping of the window.
    summary = run(
        topic="munich",
        nodes=[n.address for n in lc.nodes],
        servers=lc.servers,
        secret_file=None,
        cluster_name="roadlog",
        window_start_ms=int(options["window_start_ms"]),
        window_end_ms=int(options["window_end_ms"]),
        master="local[2]",
        out_dir=tmp_path,
    )
    assert summary["pings"] == sent
