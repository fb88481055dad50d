"""The heat-map job: pings of a topic and time window -> per H3 cell the
ping count, distinct devices, mean speed, free-flow speed and a congestion
index; committed into the cluster (replicated, served by any node under
give-to-get) and written as Parquet, GeoJSON, PNG and HTML.

``transform(df, ...)`` is pure (a DataFrame in, a DataFrame out); ``main``
is the thin shell around it: a lock (a cron run that finds the previous one
still running exits cleanly), the Spark session, the read, the commit and
the files. Re-running a window replaces its result (the cluster keys heat
maps by topic and window start; files are replaced atomically).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from roadlog.client import RoadlogError
from roadlog.v1 import client_pb2, heatmaps_pb2
from spark.cell_buckets import BUCKETS_DDL, PING_COLUMNS, CellMapper, join
from spark.cell_stats import (
    PARTIALS_DDL,
    PARTIALS_SCHEMA,
    QUANTILE,
    cell_partials,
    finish,
)
from spark.roadlog_source import RoadlogReader, read_range

log = logging.getLogger("roadlog.heatmap")

FREE_FLOW_QUANTILE = QUANTILE
# A cell jammed all through the history (or a history of minutes, as on a
# first run) would look free-flowing at its jam speed: its free-flow speed
# is at least this share of the region's. Real free-flow needs days of data.
REGION_FLOOR = 0.8
DEFAULT_HISTORY_MS = 24 * 3600 * 1000
# The columns ``transform`` uses: what the job reads (the source prunes to them).
READ_SCHEMA = "device_id string, ts_ms long, lat double, lon double, speed_mps float"
OUT_SCHEMA = (
    "h3 long, pings long, devices long, mean_speed_mps double, free_flow_mps double, "
    "congestion double"
)


CELL_SCHEMA = "h3 long, device_id string, now boolean, speed float"


def cells_of(
    df: DataFrame,
    resolution: int,
    window_start_ms: int,
    window_end_ms: int,
    region_geojson: str | None,
) -> DataFrame:
    """Per ping inside the region: its H3 cell, its device, whether it is in
    [window_start, window_end) and its speed (null when unknown): computed
    in Arrow batch by batch (``mapInArrow``: no Python per row)."""
    mapper = CellMapper(resolution, window_start_ms, window_end_ms, region_geojson)

    def add(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            m = mapper.map(b)
            if m is not None:
                yield m

    return df.select(*PING_COLUMNS).mapInArrow(add, CELL_SCHEMA)


def transform(
    df: DataFrame,
    resolution: int,
    window_start_ms: int,
    window_end_ms: int,
    region_geojson: str | None = None,
) -> DataFrame:
    """Per H3 cell with pings in [window_start, window_end): pings, distinct
    devices, mean speed; free-flow speed = the cell's 85th percentile speed
    over every row of ``df`` (the history the caller read), but at least
    0.8 of the region's 85th percentile (a histogram's: within 1/16 m/s,
    spark/cell_stats.py); congestion = 1 - mean / free-flow, clipped to
    [0, 1]. Speeds that are unknown (NaN) count as pings but not in the
    speeds.

    One pass over ``df``: each ping mapped once in Arrow and its task's
    mapped pings cut into buckets by cell (spark/cell_buckets.py), the
    buckets shuffled as a few opaque rows, every cell's figures computed in
    Arrow where all its pings are (``cell_partials``), and the few partials
    (a row a cell, a histogram a task) merged in one last task
    (``finish``)."""
    mapper = CellMapper(resolution, window_start_ms, window_end_ms, region_geojson)
    buckets = _buckets(df.sparkSession)

    def split(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield from mapper.split(batches, buckets)

    return _cells_from_buckets(df.select(*PING_COLUMNS).mapInArrow(split, BUCKETS_DDL), buckets)


def transform_source(
    spark: SparkSession,
    reader: RoadlogReader,
    resolution: int,
    window_start_ms: int,
    window_end_ms: int,
    region_geojson: str | None = None,
) -> DataFrame:
    """``transform`` of what ``reader`` reads (the source's reader of
    ``READ_SCHEMA``: the rows ``spark.read.format("roadlog")`` would give),
    each of its planned partitions read by a Spark task of its own in its
    Python worker (``read_range``, as the source's tasks do) and mapped
    there: the pings never become JVM rows, only their buckets do."""
    parts = [p.value for p in reader.partitions()]  # planned here, on the driver
    mapper = CellMapper(resolution, window_start_ms, window_end_ms, region_geojson)
    # As many buckets as read tasks (a small window: a few small tasks, not
    # spark.sql.shuffle.partitions of them), at most the shuffle partitions.
    buckets = min(_buckets(spark), max(2, len(parts)))

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            for i in b.column("task").to_pylist():
                yield from mapper.split(
                    (rb for task in parts[i] for rb in read_range(task)), buckets
                )

    if not parts:
        tasks = spark.createDataFrame([], "task int")
    else:
        rdd = spark.sparkContext.parallelize([(i,) for i in range(len(parts))], len(parts))
        tasks = spark.createDataFrame(rdd, "task int")
    return _cells_from_buckets(tasks.mapInArrow(read, BUCKETS_DDL), buckets)


def _buckets(spark: SparkSession) -> int:
    return int(spark.conf.get("spark.sql.shuffle.partitions") or 8)


def _cells_from_buckets(mapped: DataFrame, buckets: int) -> DataFrame:
    """The buckets (``BUCKETS_DDL`` rows) shuffled by bucket, each bucket's
    cells' partials in the task that holds it, the partials merged in one."""

    def per_cell(rows: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        got = cell_partials(join(rows))
        if got is not None:
            yield got

    def merged(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield finish(pa.Table.from_batches(list(batches), schema=PARTIALS_SCHEMA), REGION_FLOOR)

    partials = mapped.repartition(buckets, "bucket").mapInArrow(per_cell, PARTIALS_DDL)
    return partials.repartition(1).mapInArrow(merged, OUT_SCHEMA)


def warm_up(spark: SparkSession) -> None:
    """Run ``transform`` once over two pings: the session's Python workers
    started and its code paths loaded before a caller's first job."""
    import pandas as pd

    pdf = pd.DataFrame(
        {
            "device_id": ["a", "b"],
            "ts_ms": [1, 2],
            "lat": [48.1, 48.1],
            "lon": [11.5, 11.5],
            "speed_mps": np.array([1.0, 2.0], np.float32),
        }
    )
    df = spark.createDataFrame(pdf, READ_SCHEMA)
    transform(df, 9, 0, 10).toArrow()


# ------------------------------------------------------------------ shell


def session(master: str, app: str = "roadlog-heatmap") -> SparkSession:
    """A Spark session with the roadlog source registered. Executors run
    this virtualenv's Python (same hosts), or a packed one given as
    ROADLOG_SPARK_ENV (a venv-pack archive, shipped with spark.archives)."""
    from spark.roadlog_source import RoadlogDataSource

    b = SparkSession.builder.master(master).appName(app)
    if master.startswith("local"):  # nothing leaves this host
        b = b.config("spark.driver.host", "127.0.0.1").config(
            "spark.driver.bindAddress", "127.0.0.1"
        )
    b = b.config("spark.sql.shuffle.partitions", "8").config("spark.ui.enabled", "false")
    b = b.config("spark.ui.showConsoleProgress", "false")  # roadlog shows its own progress
    packed = os.environ.get("ROADLOG_SPARK_ENV")
    if packed:
        b = b.config("spark.archives", f"{packed}#environment")
        b = b.config("spark.pyspark.python", "./environment/bin/python")
    else:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        b = b.config("spark.pyspark.python", sys.executable)
        b = b.config("spark.executorEnv.PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("ROADLOG_SPARK_LOG_LEVEL", "ERROR"))
    spark.dataSource.register(RoadlogDataSource)
    return spark


class AlreadyRunning(Exception):
    pass


def lock(path: Path) -> Any:
    """Hold an exclusive lock for the job's lifetime; AlreadyRunning if a
    previous run still holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "w")  # noqa: SIM115 - held open on purpose
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise AlreadyRunning(f"{path} is held: a previous run is still going") from None
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def read_options(
    *,
    topic: str,
    nodes: list[str],
    fences: client_pb2.ReadFencesResponse,
    secret_file: Path | None,
    cluster_name: str,
    start_ms: int,
    end_ms: int,
) -> dict[str, str]:
    """The roadlog source's options for the pings of ``topic`` in
    [start_ms, end_ms) acknowledged before ``fences`` (ReadFences: each
    group's commit index at its leader, so the plan holds every one of
    them, whichever node plans it)."""
    return {
        "nodes": ",".join(nodes),
        "min_applied_index": str(fences.applied_index),
        "group_fences": ",".join(f"{f.group}:{f.applied_index}" for f in fences.group_fences),
        "secret_file": str(secret_file or ""),
        "cluster_name": cluster_name,
        "topic": topic,
        "window_start_ms": str(start_ms),
        "window_end_ms": str(end_ms),
    }


def run(
    *,
    topic: str,
    nodes: list[str],
    servers: list[str],
    secret_file: Path | None,
    cluster_name: str,
    window_start_ms: int,
    window_end_ms: int,
    master: str = "local[2]",
    out_dir: Path = Path("out/heatmaps"),
    history_ms: int = DEFAULT_HISTORY_MS,
    spark: SparkSession | None = None,
) -> dict[str, Any]:
    """Build, commit and write one window's heat map; what was done.
    ``spark``: a session to use and leave running (the warm job server's);
    else one is started on ``master`` and stopped at the end."""
    from roadlog.client import Admin, Connection

    t0 = time.monotonic()
    with Connection(servers) as conn:
        desc = Admin(conn).describe(topic)
        # The plan holds every ping acknowledged before now, whichever node
        # plans it: each group's commit index at its leader.
        fences = conn.call("ReadFences", client_pb2.ReadFencesRequest(topic=topic), timeout=30)
    spec = desc.topic.spec
    own = spark is None
    if spark is None:
        spark = session(master)
    try:
        options = read_options(
            topic=topic,
            nodes=nodes,
            fences=fences,
            secret_file=secret_file,
            cluster_name=cluster_name,
            start_ms=window_end_ms - max(history_ms, window_end_ms - window_start_ms),
            end_ms=window_end_ms,
        )
        result = transform_source(
            spark,
            RoadlogReader(options, PING_COLUMNS),
            spec.h3_resolution,
            window_start_ms,
            window_end_ms,
            spec.region_geojson,
        )
        table = result.toArrow()
    finally:
        if own:
            spark.stop()
    hm, cells = to_heatmap(table, topic, spec.h3_resolution, list(desc.topic.bbox),
                           window_start_ms, window_end_ms)  # fmt: skip
    with Connection(servers) as conn:
        index = Admin(conn).put_heatmap(hm)
    where = write_files(hm, cells, out_dir)
    summary = {
        "topic": topic,
        "window_start_ms": window_start_ms,
        "window_end_ms": window_end_ms,
        "cells": len(hm.cells.h3),
        "pings": hm.source_pings,
        "applied_index": index,
        "dir": str(where),
        "seconds": round(time.monotonic() - t0, 1),
    }
    (where / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def to_heatmap(
    table: pa.Table,
    topic: str,
    resolution: int,
    bbox: list[float],
    window_start_ms: int,
    window_end_ms: int,
) -> tuple[heatmaps_pb2.HeatMap, pa.Table]:
    """``transform``'s result (as Arrow) as the HeatMap the cluster stores,
    cells in H3 order; and the table in that order."""
    cols = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    order = np.argsort(cols["h3"], kind="stable") if len(cols["h3"]) else np.array([], dtype=int)
    hm = heatmaps_pb2.HeatMap(
        topic=topic,
        window_start_ms=window_start_ms,
        window_end_ms=window_end_ms,
        h3_resolution=resolution,
        computed_ms=int(time.time() * 1000),
        source_pings=int(cols["pings"].sum()) if len(order) else 0,
        bbox=bbox,
    )
    c = hm.cells
    c.h3.extend(int(x) for x in cols["h3"][order].astype(np.uint64))
    c.pings.extend(int(x) for x in cols["pings"][order])
    c.devices.extend(int(x) for x in cols["devices"][order])
    for name, field in (
        ("mean_speed_mps", c.mean_speed_mps),
        ("free_flow_mps", c.free_flow_mps),
        ("congestion", c.congestion),
    ):
        field.extend(cols[name][order].astype(float).tolist())
    return hm, table.take(pa.array(order, type=pa.int64()))


def write_files(hm: heatmaps_pb2.HeatMap, cells: pa.Table, out_dir: Path) -> Path:
    """The window's Parquet, GeoJSON, PNG and HTML under
    ``out_dir/TOPIC/WINDOW_START/``, each replaced atomically; that folder."""
    import pyarrow.parquet as pq

    from roadlog.heatmap_render import write_geojson, write_html, write_png

    where = out_dir / hm.topic / str(hm.window_start_ms)
    where.mkdir(parents=True, exist_ok=True)
    tmp = where / "cells.parquet.tmp"
    pq.write_table(cells, tmp)
    os.replace(tmp, where / "cells.parquet")
    write_geojson(hm, where / "heatmap.geojson")
    write_png(hm, where / "heatmap.png")
    write_html(hm, where / "heatmap.html")
    return where


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--nodes", required=True, help="node gRPC HOST:PORT,...")
    ap.add_argument("--servers", required=True, help="queue server HOST:PORT,...")
    ap.add_argument(
        "--secret-file", type=Path, help="the cluster secret (only without TLS: with TLS the "
        "client certificate in ROADLOG_CERT_FILE/ROADLOG_KEY_FILE is the credential)",
    )  # fmt: skip
    ap.add_argument("--cluster-name", default="roadlog")
    ap.add_argument("--since-ms", type=int, default=15 * 60_000)
    ap.add_argument("--window", help="START_MS,END_MS (else the last --since-ms)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--out", type=Path, default=Path("out/heatmaps"))
    ap.add_argument("--lock", type=Path, default=Path("/tmp/roadlog-heatmap.lock"))
    args = ap.parse_args(argv)
    try:
        held = lock(args.lock)
    except AlreadyRunning as e:
        print(f"not running: {e}", file=sys.stderr)
        return 0
    try:
        if args.window:
            start, end = (int(x) for x in args.window.split(","))
        else:
            end = int(time.time() * 1000)
            start = end - args.since_ms
        try:
            summary = run(
                topic=args.topic,
                nodes=args.nodes.split(","),
                servers=args.servers.split(","),
                secret_file=args.secret_file,
                cluster_name=args.cluster_name,
                window_start_ms=start,
                window_end_ms=end,
                master=args.master,
                out_dir=args.out,
            )
        except RoadlogError as e:  # unknown topic, cluster unavailable: one clear line
            print(f"heatmap {args.topic}: {e}", file=sys.stderr)
            return 1
    finally:
        held.close()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
