"""The heat-map job on Spark, against a local cluster with TLS and tokens as
deployed (the nodes' mutual TLS: the reader's client certificate of the
cluster's CA; the job's connections carry the cluster's Spark identity).

1. H3 mapping rate of the vectorised mapper (points/s).
2. Job time (read through the roadlog data source, transform, commit,
   write the files) for each of ``--sizes`` pings, in local mode and on a
   standalone master + worker (started from spark-class on 127.0.0.1).
3. The warm job server (``roadlog heatmap serve``, a process of its own
   with one long-lived Spark session): a window of ``--warm-pings`` pings
   (a topic of its own) built through it ``--repeats`` times, against the
   same window built with a Spark started for it (``run``), alternated.
4. Reading the same pings through the data source against reading them
   from Parquet, two queries: every column (a mean of each numeric column
   and a distinct count of devices) and two (the count and the mean speed;
   the source is given the schema ``speed_mps float``: it prunes to it).
   Source and Parquet alternate, ``--repeats`` times each: medians and
   the spread.

Bounded: every load is a fixed count, and a step that would start after
``--budget-s`` is skipped (said so in the result). The cluster is one node,
``--data-groups`` data groups (1: every ping in group 0).

Writes bench/results/spark_heatmap.json (``--out`` another name).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
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
TOPIC = "bench"
NUMERIC = ("partition", "offset", "ts_ms", "lat", "lon", "speed_mps", "heading_deg",
           "accuracy_m", "append_ms")  # fmt: skip


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def h3_rate(n: int = 4_000_000) -> float:
    rng = np.random.default_rng(1)
    lat, lon = rng.uniform(48.08, 48.20, n), rng.uniform(11.45, 11.70, n)
    t0 = time.perf_counter()
    cells_for(lat, lon, 9)
    return n / (time.perf_counter() - t0)


def pings(n: int, start: int, end_ms: int) -> PingColumns:
    """``n`` pings of 5,000 vehicles in the last 10 minutes before ``end_ms``,
    every column known."""
    rng = np.random.default_rng(start)
    return PingColumns.from_columns(
        [f"veh-{i % 5000:05d}" for i in range(n)],
        end_ms - rng.integers(0, 600_000, n),
        rng.uniform(48.08, 48.20, n),
        rng.uniform(11.45, 11.70, n),
        speed_mps=rng.uniform(0, 20, n).astype(np.float32),
        heading_deg=rng.uniform(0, 359, n).astype(np.float32),
        accuracy_m=rng.uniform(2, 30, n).astype(np.float32),
    )


def deployed_env(lc: LocalCluster) -> None:
    """What the heat-map role sets for its jobs: the cluster's CA and a
    client certificate of it (the nodes' port is mutual TLS), and the Spark
    identity's token. Spark's JVM and Python workers inherit it."""
    tls = lc.tls()
    for name, path in (
        ("ROADLOG_CA_FILE", tls.ca_file),
        ("ROADLOG_CERT_FILE", tls.cert_file),
        ("ROADLOG_KEY_FILE", tls.key_file),
    ):
        if path is None:
            raise RuntimeError("the bench's cluster runs with TLS, as deployed")
        os.environ[name] = str(path)
    os.environ.pop("ROADLOG_INSECURE", None)
    token = lc.spark_token
    if not token:
        raise RuntimeError("the local cluster made no Spark identity")
    os.environ["ROADLOG_TOKEN"] = token


def load(lc: LocalCluster, have: int, size: int, end: int) -> int:
    """Publish pings until ``size`` are stored; the count stored."""
    # The connection is closed again before Spark starts: a JVM launched
    # (fork + exec) while gRPC threads run may die at fork.
    with Connection(lc.servers, timeout=120, tls=lc.tls()) as conn:
        p = Producer(conn, TOPIC, client="bench", batch_pings=50_000)
        while have < size:
            k = min(50_000, size - have)
            p.send_batch(pings(k, have, end))
            have += k
        p.close()
    return have


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2),
            "max": round(max(xs), 2)}  # fmt: skip


def read_compare(
    lc: LocalCluster, start: int, end: int, work: Path, repeats: int, prune: bool = True
) -> dict[str, Any]:
    """Both queries through the source and from Parquet, alternated;
    ``prune``: the two-column query gives the source its schema."""
    from pyspark.sql import functions as F

    spark = session("local[2]", "roadlog-read-bench")
    try:

        def source(schema: str | None = None) -> Any:
            r = spark.read.format("roadlog")
            if schema:
                r = r.schema(schema)
            return (
                r.option("nodes", ",".join(n.address for n in lc.nodes))
                .option("topic", TOPIC)
                .option("window_start_ms", str(start))
                .option("window_end_ms", str(end))
                .load()
            )

        t0 = time.monotonic()
        source().write.mode("overwrite").parquet(str(work / "pings.parquet"))
        say(f"wrote the Parquet copy in {time.monotonic() - t0:.1f} s")
        pq = spark.read.parquet(str(work / "pings.parquet"))
        every = [
            *(F.avg(c).alias(c) for c in NUMERIC),
            F.countDistinct("device_id").alias("devices"),
            F.count(F.lit(1)).alias("n"),
        ]
        two = [F.count(F.lit(1)).alias("n"), F.avg("speed_mps").alias("speed_mps")]
        queries = {
            "every_column": (lambda: source(), lambda: pq, every),
            "two_columns": (lambda: source("speed_mps float" if prune else None), lambda: pq, two),
        }
        out: dict[str, Any] = {}
        for name, (src, par, aggs) in queries.items():
            times: dict[str, list[float]] = {"source": [], "parquet": []}
            answers: dict[str, Any] = {}
            for _ in range(repeats):
                for side, df in (("source", src), ("parquet", par)):
                    t0 = time.monotonic()
                    row = df().agg(*aggs).collect()[0].asDict()
                    times[side].append(time.monotonic() - t0)
                    answers[side] = row
            a, b = answers["source"], answers["parquet"]
            assert a["n"] == b["n"], (a, b)
            for k in a:  # the same answer from both (means to float rounding)
                assert abs(float(a[k]) - float(b[k])) <= 1e-6 * max(1.0, abs(float(b[k]))), (
                    k,
                    a,
                    b,
                )
            src_s, par_s = spread(times["source"]), spread(times["parquet"])
            out[name] = {
                "rows": int(a["n"]),
                "source_s": src_s,
                "parquet_s": par_s,
                "ratio_source_to_parquet_time": round(src_s["median"] / par_s["median"], 2),
            }
            say(f"read {name}: {out[name]}")
    finally:
        spark.stop()
    return out


def warm_compare(lc: LocalCluster, pings_n: int, work: Path, repeats: int) -> dict[str, Any]:
    """A window of ``pings_n`` pings through the warm job server and with a
    Spark of its own, alternated ``repeats`` times; seconds, asked to
    answered (the server's: the client's whole call, TLS and all)."""
    import subprocess

    from roadlog.runtime.processes import free_port
    from spark.job_client import submit
    from spark.job_server import JobRequest

    topic = "warm"
    end = int(time.time() * 1000)
    with Connection(lc.servers, timeout=120, tls=lc.tls()) as conn:
        Admin(conn).create_topic(topic, REGION.geojson, 8)
        p = Producer(conn, topic, client="bench", batch_pings=50_000)
        sent = 0
        while sent < pings_n:
            k = min(50_000, pings_n - sent)
            p.send_batch(pings(k, sent, end))
            sent += k
        p.close()
    port = free_port()
    log = open(work / "serve.log", "w")  # noqa: SIM115 - the server's, closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "roadlog.cli", "heatmap", "serve", "--servers",
         ",".join(lc.servers), "--listen", f"127.0.0.1:{port}", "--certs-dir",
         lc.queue_servers[0].certs_dir, "--out", str(work / "served")],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    job = JobRequest(topic, end - 600_000, end + 1)
    address = f"127.0.0.1:{port}"
    tls = lc.tls()
    token = os.environ["ROADLOG_TOKEN"]
    t0 = time.monotonic()
    try:
        while True:  # the server's start: bounded
            try:
                from spark.job_client import _ask

                if _ask(address, tls, "GET", "/healthz", 2.0)[1].get("ready"):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                raise RuntimeError(f"the job server did not start: {work / 'serve.log'}")
            time.sleep(0.5)
        started = time.monotonic() - t0
        say(f"job server ready in {started:.1f} s")
        times: dict[str, list[float]] = {"warm": [], "cold": []}
        cells = {}
        for _ in range(repeats):
            t1 = time.monotonic()
            cells["warm"] = submit(address, job, tls, token)["cells"]
            times["warm"].append(time.monotonic() - t1)
            t1 = time.monotonic()
            cells["cold"] = run(
                topic=topic, nodes=[n.address for n in lc.nodes], servers=lc.servers,
                secret_file=None, cluster_name="roadlog", window_start_ms=job.window_start_ms,
                window_end_ms=job.window_end_ms, out_dir=work / "maps",
            )["cells"]  # fmt: skip
            times["cold"].append(time.monotonic() - t1)
            say(f"window of {pings_n:,}: warm {times['warm'][-1]:.1f} s, "
                f"cold {times['cold'][-1]:.1f} s")  # fmt: skip
        assert cells["warm"] == cells["cold"], cells
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
    return {"pings": pings_n, "cells": cells["warm"], "server_start_s": round(started, 1),
            "warm_s": spread(times["warm"]), "cold_s": spread(times["cold"]),
            "warm_all_s": [round(x, 2) for x in times["warm"]]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000000,10000000", help="pings of each job run")
    ap.add_argument("--masters", default="local,standalone")
    ap.add_argument("--read-pings", type=int, default=10_000_000,
                    help="pings of the read comparison (0: none)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="of each read, alternated")
    ap.add_argument("--warm-pings", type=int, default=100_000,
                    help="pings of the warm server's window (0: no warm step)")  # fmt: skip
    ap.add_argument("--no-prune", action="store_true",
                    help="give the source no schema (a reader that cannot prune)")  # fmt: skip
    ap.add_argument("--data-groups", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=1800, help="no step starts after this")
    ap.add_argument("--out", default="spark_heatmap")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    sizes = sorted(int(s) for s in args.sizes.split(",") if s)
    masters = [m for m in args.masters.split(",") if m]
    rate = h3_rate()
    say(f"H3 mapping: {rate:,.0f} points/s")
    jobs: list[dict[str, Any]] = []
    reads: dict[str, Any] = {}
    warm: dict[str, Any] = {}
    skipped: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="roadlog-spark-bench-", dir="/var/tmp"))
    lc = LocalCluster.create(work / "cluster", 1, 1, data_groups=args.data_groups)
    lc.start_all()

    def in_budget(step: str) -> bool:
        if time.monotonic() - t_start < args.budget_s:
            return True
        skipped.append(step)
        say(f"skipped (past --budget-s): {step}")
        return False

    try:
        lc.wait_ready(60)
        deployed_env(lc)
        end = int(time.time() * 1000)
        loaded = 0
        with Connection(lc.servers, timeout=120, tls=lc.tls()) as conn:
            Admin(conn).create_topic(TOPIC, REGION.geojson, 8)
        for size in sizes:
            if not in_budget(f"jobs of {size} pings"):
                continue
            t0 = time.monotonic()
            loaded = load(lc, loaded, size, end)
            say(f"loaded {loaded:,} pings ({time.monotonic() - t0:.0f} s)")
            for master_kind in masters:
                if not in_budget(f"job of {size} pings, {master_kind}"):
                    continue
                common: dict[str, Any] = {
                    "topic": TOPIC,
                    "nodes": [n.address for n in lc.nodes],
                    "servers": lc.servers,
                    "secret_file": None,  # with TLS the client certificate is the credential
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
                say(f"job, {loaded:,} pings, {master_kind}: {secs:.1f} s")
        if args.warm_pings and in_budget(f"warm server, {args.warm_pings} pings"):
            warm = warm_compare(lc, args.warm_pings, work, args.repeats)
            say(f"warm server: {warm}")
        if args.read_pings and in_budget(f"reads of {args.read_pings} pings"):
            t0 = time.monotonic()
            loaded = load(lc, loaded, args.read_pings, end)
            say(f"loaded {loaded:,} pings ({time.monotonic() - t0:.0f} s)")
            reads = read_compare(lc, end - 600_000, end + 1, work, args.repeats, not args.no_prune)
    finally:
        lc.down(grace=3)
        shutil.rmtree(work, ignore_errors=True)
    doc = {
        "setup": f"one node, one queue server, TLS and tokens, data_groups={args.data_groups}; "
        "Spark local[2] for the reads",
        "h3_points_per_s": round(rate),
        "jobs": jobs,
        "warm_server": warm,
        "read": reads,
        "skipped": skipped,
        "seconds": round(time.monotonic() - t_start),
    }
    print(write_result(args.out, doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
