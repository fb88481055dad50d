"""The heat-map job on Spark.

1. H3 mapping rate of the vectorised mapper (points/s).
2. Job time (read through the roadlog data source, transform, commit,
   write the files) for 1M and 10M pings, in local mode and on a standalone
   master + worker (started from spark-class on 127.0.0.1).
3. Reading the same pings through the data source against reading them
   from Parquet (a count and a mean over every row): the ratio.

Writes bench/results/spark_heatmap.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_result
from roadlog.client import Admin, Connection, Producer
from roadlog.columnar import PingColumns
from roadlog.geo import bbox_region
from roadlog.tools.localcluster import LocalCluster
from spark.h3cells import cells_for
from spark.jobs.heatmap import run, session
from spark.standalone import local_standalone

REGION = bbox_region(11.45, 48.08, 11.70, 48.20)


def h3_rate(n: int = 4_000_000) -> float:
    rng = np.random.default_rng(1)
    lat, lon = rng.uniform(48.08, 48.20, n), rng.uniform(11.45, 11.70, n)
    t0 = time.perf_counter()
    cells_for(lat, lon, 9)
    return n / (time.perf_counter() - t0)


def pings(n: int, start: int, end_ms: int) -> PingColumns:
    rng = np.random.default_rng(start)
    return PingColumns.from_columns(
        [f"veh-{i % 5000:05d}" for i in range(n)],
        end_ms - rng.integers(0, 600_000, n),
        rng.uniform(48.08, 48.20, n),
        rng.uniform(11.45, 11.70, n),
        speed_mps=rng.uniform(0, 20, n).astype(np.float32),
    )


def read_compare(lc: LocalCluster, start: int, end: int, work: Path) -> dict[str, Any]:
    spark = session("local[2]", "roadlog-read-bench")
    try:
        df = (
            spark.read.format("roadlog")
            .option("nodes", ",".join(n.address for n in lc.nodes))
            .option("secret_file", lc.secret_file)
            .option("topic", "bench")
            .option("window_start_ms", str(start))
            .option("window_end_ms", str(end))
            .load()
        )
        t0 = time.monotonic()
        n_source = df.agg({"speed_mps": "avg", "*": "count"}).collect()
        source_s = time.monotonic() - t0
        df.write.mode("overwrite").parquet(str(work / "pings.parquet"))
        pq = spark.read.parquet(str(work / "pings.parquet"))
        t0 = time.monotonic()
        n_parquet = pq.agg({"speed_mps": "avg", "*": "count"}).collect()
        parquet_s = time.monotonic() - t0
    finally:
        spark.stop()
    rows = int(n_source[0]["count(1)"])
    assert rows == int(n_parquet[0]["count(1)"])
    return {
        "rows": rows,
        "source_s": round(source_s, 2),
        "parquet_s": round(parquet_s, 2),
        "source_rows_per_s": round(rows / source_s),
        "ratio_source_to_parquet_time": round(source_s / parquet_s, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1000000,10000000")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rate = h3_rate()
    print(f"H3 mapping: {rate:,.0f} points/s", file=sys.stderr, flush=True)
    jobs: list[dict[str, Any]] = []
    reads: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="roadlog-spark-bench-", dir="/var/tmp"))
    lc = LocalCluster.create(work / "cluster", 1, 1, data_groups=1)  # one group, as measured
    lc.start_all()
    try:
        lc.wait_ready(60)
        end = int(time.time() * 1000)
        loaded = 0
        with Connection(lc.servers, timeout=120, tls=lc.tls()) as conn:
            Admin(conn).create_topic("bench", REGION.geojson, 8)
        for size in sizes:
            # Load with the connection closed again before Spark starts: a JVM
            # launched (fork + exec) while gRPC threads run may die at fork.
            with Connection(lc.servers, timeout=120, tls=lc.tls()) as conn:
                p = Producer(conn, "bench", client="bench", batch_pings=50_000)
                while loaded < size:
                    k = min(50_000, size - loaded)
                    p.send_batch(pings(k, loaded, end))
                    loaded += k
                p.close()
            print(f"loaded {loaded:,} pings", file=sys.stderr, flush=True)
            for master_kind in ("local", "standalone"):
                common: dict[str, Any] = {
                    "topic": "bench",
                    "nodes": [n.address for n in lc.nodes],
                    "servers": lc.servers,
                    "secret_file": Path(lc.secret_file),
                    "cluster_name": "roadlog",
                    "window_start_ms": end - 600_000,
                    "window_end_ms": end + 1,
                    "out_dir": work / "maps",
                }
                if master_kind == "local":
                    t0 = time.monotonic()
                    summary = run(master="local[2]", **common)
                else:
                    with local_standalone(work, memory="4g") as url:
                        t0 = time.monotonic()
                        summary = run(master=url, **common)
                secs = time.monotonic() - t0
                jobs.append(
                    {"pings": loaded, "master": master_kind, "seconds": round(secs, 1),
                     "cells": summary["cells"], "pings_per_s": round(loaded / secs)}
                )  # fmt: skip
                print(f"job, {loaded:,} pings, {master_kind}: {secs:.1f} s", file=sys.stderr)
        reads = read_compare(lc, end - 600_000, end + 1, work)
        print(f"reads: {reads}", file=sys.stderr)
    finally:
        lc.down(grace=3)
        shutil.rmtree(work, ignore_errors=True)
    print(
        write_result("spark_heatmap", {"h3_points_per_s": round(rate), "jobs": jobs, "read": reads})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
