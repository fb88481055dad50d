"""The streaming heat map: Spark Structured Streaming over the roadlog
stream reader keeps a topic's heat map current.

Every trigger (``every``, aligned to the clock: 60 s triggers fire at each
minute) reads the pings committed since the last one (a micro-batch of
offset ranges, the node on the task's host first) and commits into the
cluster the heat map of the window that ends at the trigger, ``[end -
window, end)``, with the batch job's ``transform`` over the same rows the
batch job reads (the pings of ``[end - history, end)``): a streamed window
and ``roadlog heatmap build`` of the same window give the same cells and
figures.

Event time and lateness. A window is computed at the trigger at its end and
computed again, with the pings that arrive later, at each trigger up to
``lateness`` after its end (windows ending in ``(end - lateness, end]`` are
open). A ping is late when it arrives after the window end before its
timestamp's had passed (it lands in those windows, which are committed
again); it is too late when every window holding its timestamp is closed:
it is counted (``too_late`` in the trigger's line,
``roadlog_heatmap_stream_too_late_pings_total``) and kept for the free-flow
history of later windows, but it is in no streamed window (a batch build of
such a window afterwards includes it). The first micro-batch of a new query
reads the history (``history`` back), computes the current window only and
counts nothing as late.

Restarts. The checkpoint directory holds Spark's offset and commit logs
(``spark/``) and the history the windows are computed from (``history/``):
the pings of each micro-batch as Parquet, named by batch id (a batch run
again after a crash rewrites its own file, so nothing is counted twice),
compacted every ``COMPACT_EVERY`` batches to what later windows still need,
and for each finished batch the window end it used (a batch run again
computes the same windows). A query restarted from the checkpoint goes on at
the offsets after the last committed batch: no ping is lost or repeated.
The history is the driver's (the Spark master's, when run as the service):
24 h of a city's pings fit there; a shorter ``history`` bounds it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from roadlog.v1 import heatmaps_pb2
from spark.arrow_batches import ARROW_TYPES
from spark.jobs.heatmap import DEFAULT_HISTORY_MS, session, to_heatmap, transform, write_files

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("roadlog.heatmap.stream")

COLUMNS = ("partition", "offset", "device_id", "ts_ms", "lat", "lon", "speed_mps")
SPARK_TYPES = {"partition": "int", "offset": "long", "device_id": "string", "ts_ms": "long",
               "lat": "double", "lon": "double", "speed_mps": "float"}  # fmt: skip
COMPACT_EVERY = 10
KEEP_RECORDS = 20
DEFAULT_EVERY_MS = 60_000
DEFAULT_WINDOW_MS = 15 * 60_000
DEFAULT_LATENESS_MS = 10 * 60_000
# A ping appended this long before its own time still counts (clock skew),
# as in the batch job's read (spark.roadlog_source DEFAULT_LEAD_MS).
START_LEAD_MS = 5 * 60_000


# ------------------------------------------------------------------ windows


@dataclass(frozen=True)
class Windows:
    """Sliding windows of ``window_ms`` ending every ``every_ms`` (at
    multiples of it), each open for ``lateness_ms`` after its end."""

    every_ms: int = DEFAULT_EVERY_MS
    window_ms: int = DEFAULT_WINDOW_MS
    lateness_ms: int = DEFAULT_LATENESS_MS

    def __post_init__(self) -> None:
        if self.every_ms <= 0 or self.window_ms <= 0 or self.lateness_ms < 0:
            raise ValueError("every and window must be positive, lateness at least 0")

    def end_at(self, now_ms: int) -> int:
        """The end of the window a trigger at ``now_ms`` computes."""
        return now_ms // self.every_ms * self.every_ms

    def open_ends(self, end: int) -> list[int]:
        """Window ends still open at the trigger ending ``end``, newest first."""
        n = max(1, -(-self.lateness_ms // self.every_ms))
        return [end - k * self.every_ms for k in range(n)]

    def plan(self, ts_ms: np.ndarray[Any, Any], end: int, first: bool) -> Plan:
        """What a trigger at ``end`` does with new pings of these times: the
        windows to compute (the current one always, an earlier open one
        when a new ping falls in it), how many pings came late and too late.
        The first micro-batch of a query is the history: the current window
        only, nothing late."""
        if first:
            return Plan([end], 0, 0)
        opens = self.open_ends(end)
        ends = [end]
        for e in opens[1:]:
            if np.any((ts_ms >= e - self.window_ms) & (ts_ms < e)):
                ends.append(e)
        late = int(np.count_nonzero(ts_ms < end - self.every_ms))
        too_late = int(np.count_nonzero(ts_ms < opens[-1] - self.window_ms))
        return Plan(sorted(ends), late - too_late, too_late)


@dataclass(frozen=True)
class Plan:
    ends: list[int]
    late: int  # came after a window holding its time was committed
    too_late: int  # in no open window: counted, in no streamed window


# ------------------------------------------------------------------ history

_PART = re.compile(r"^([bc])(\d{10})\.parquet$")


class History:
    """The pings later windows need, by micro-batch, in memory and on disk
    (see the module's doc): ``b<batch>.parquet`` per batch,
    ``c<batch>.parquet`` the compaction of every batch up to that one,
    ``b<batch>.json`` what a finished batch did."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.compacted = -1
        self.parts: dict[int, pa.Table] = {}
        found = [(m.group(1), int(m.group(2))) for p in self.dir.iterdir()
                 if (m := _PART.match(p.name))]  # fmt: skip
        cs = [i for kind, i in found if kind == "c"]
        if cs:
            self.compacted = max(cs)
            self.parts[self.compacted] = pq.read_table(self._path("c", self.compacted))
        for kind, i in found:
            if kind == "b" and i > self.compacted:
                self.parts[i] = pq.read_table(self._path("b", i))

    def _path(self, kind: str, batch: int, ext: str = "parquet") -> Path:
        return self.dir / f"{kind}{batch:010d}.{ext}"

    def add(self, batch: int, table: pa.Table) -> None:
        """The pings of micro-batch ``batch`` (again, when it runs again)."""
        if batch <= self.compacted:
            return  # already in the compaction (it ran, then the query stopped)
        _write_parquet(table, self._path("b", batch))
        self.parts[batch] = table

    def between(self, lo_ms: int, hi_ms: int) -> pa.Table:
        """The pings with ``lo_ms <= ts_ms < hi_ms``."""
        tables = [_between(t, lo_ms, hi_ms) for _, t in sorted(self.parts.items())]
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return pa.table({c: pa.array([], type=TYPES[c]) for c in COLUMNS})
        return pa.concat_tables(tables)

    def record(self, batch: int) -> dict[str, Any] | None:
        """What batch ``batch`` did, if it finished before."""
        path = self._path("b", batch, "json")
        return dict(json.loads(path.read_text())) if path.exists() else None

    def last_record(self) -> dict[str, Any] | None:
        """What the latest finished batch did, if one did."""
        found = [int(p.stem[1:]) for p in self.dir.glob("b*.json") if p.stem[1:].isdigit()]
        return self.record(max(found)) if found else None

    def done(self, batch: int, record: dict[str, Any], keep_from_ms: int) -> None:
        """Batch ``batch`` is done: its record; every ``COMPACT_EVERY``
        batches, the pings before ``keep_from_ms`` are dropped and the rest
        compacted into one file."""
        _write_bytes(self._path("b", batch, "json"), json.dumps(record).encode())
        if batch % COMPACT_EVERY or batch <= self.compacted:
            return
        kept = self.between(keep_from_ms, 2**62)
        _write_parquet(kept, self._path("c", batch))
        old = [i for i in self.parts if i <= batch]
        self.parts = {i: t for i, t in self.parts.items() if i > batch}
        self.parts[batch] = kept
        previous, self.compacted = self.compacted, batch
        for i in old:
            self._path("b", i).unlink(missing_ok=True)
        if previous >= 0:
            self._path("c", previous).unlink(missing_ok=True)
        for p in self.dir.glob("b*.json"):
            if int(p.stem[1:]) < batch - KEEP_RECORDS:
                p.unlink(missing_ok=True)


# The source's Arrow types (spark/arrow_batches.py) of the columns read here.
TYPES = {c: ARROW_TYPES[c] for c in COLUMNS}


def _between(t: pa.Table, lo: int, hi: int) -> pa.Table:
    ts = t.column("ts_ms").to_numpy(zero_copy_only=False)
    keep = (ts >= lo) & (ts < hi)
    return t if keep.all() else t.filter(pa.array(keep))


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_parquet(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------ metrics


class Metrics:
    """The stream's counters (Prometheus, when the process serves them;
    monitoring/grafana/roadlog.json shows them, and the alert
    RoadlogHeatmapStreamStalled of monitoring/prometheus/roadlog-rules.yml
    compares the last window's end with the trigger interval)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        reg = REGISTRY if registry is None else registry
        self.pings = Counter(
            "roadlog_heatmap_stream_pings_total",
            "Pings the heat-map stream read",
            ["topic"],
            registry=reg,
        )
        self.late = Counter(
            "roadlog_heatmap_stream_late_pings_total",
            "Pings that came after a window holding them was committed (it was committed again)",
            ["topic"],
            registry=reg,
        )
        self.too_late = Counter(
            "roadlog_heatmap_stream_too_late_pings_total",
            "Pings that came when every window holding them was closed (in no streamed window)",
            ["topic"],
            registry=reg,
        )
        self.windows = Counter(
            "roadlog_heatmap_stream_windows_total",
            "Heat-map windows the stream committed",
            ["topic"],
            registry=reg,
        )
        self.seconds = Gauge(
            "roadlog_heatmap_stream_batch_seconds",
            "How long the last micro-batch took",
            ["topic"],
            registry=reg,
        )
        self.interval = Gauge(
            "roadlog_heatmap_stream_trigger_interval_seconds",
            "The stream's trigger interval (--every)",
            ["topic"],
            registry=reg,
        )
        self.window_end = Gauge(
            "roadlog_heatmap_stream_last_window_end_seconds",
            "End of the newest window the stream committed (epoch seconds; after a restart, "
            "the last one its checkpoint recorded)",
            ["topic"],
            registry=reg,
        )
        self._last_end: dict[str, int] = {}

    def committed(self, topic: str, end_ms: int) -> None:
        """The window ending at ``end_ms`` was committed (never moves back:
        a micro-batch run again commits an older one again)."""
        end = self._last_end[topic] = max(self._last_end.get(topic, end_ms), end_ms)
        self.window_end.labels(topic).set(end / 1000)


# ------------------------------------------------------------------ the job


@dataclass
class StreamJob:
    """What each micro-batch does (``foreachBatch``)."""

    spark: SparkSession
    topic: str
    servers: list[str]
    checkpoint: Path
    windows: Windows = field(default_factory=Windows)
    history_ms: int = DEFAULT_HISTORY_MS
    out_dir: Path | None = None
    metrics: Metrics | None = None
    clock: Callable[[], float] = time.time
    report: Callable[[dict[str, Any]], None] = lambda summary: None
    history: History = field(init=False)
    spec: Any = field(init=False)
    bbox: list[float] = field(init=False)

    def __post_init__(self) -> None:
        from roadlog.client import Admin, Connection

        if self.history_ms < self.windows.window_ms:
            raise ValueError("the history must be at least as long as the window")
        with Connection(self.servers) as conn:
            desc = Admin(conn).describe(self.topic)
        self.spec = desc.topic.spec
        self.bbox = list(desc.topic.bbox)
        self.history = History(self.checkpoint / "history")
        if self.metrics is not None:
            self.metrics.interval.labels(self.topic).set(self.windows.every_ms / 1000)
            last = self.history.last_record()
            if last is not None:
                self.metrics.committed(self.topic, int(last["end"]))

    def process(self, df: DataFrame, batch: int) -> None:
        from roadlog.client import Admin, Connection

        t0 = time.monotonic()
        before = self.history.record(batch)
        end = int(before["end"]) if before else self.windows.end_at(int(self.clock() * 1000))
        new = df.select(*COLUMNS).toArrow().cast(pa.schema([(c, TYPES[c]) for c in COLUMNS]))
        self.history.add(batch, new)
        ts = new.column("ts_ms").to_numpy(zero_copy_only=False)
        plan = self.windows.plan(ts, end, first=batch == 0)
        maps = self.compute(plan.ends)
        indexes = []
        with Connection(self.servers) as conn:
            admin = Admin(conn)
            for e in plan.ends:
                hm, cells = maps[e]
                indexes.append(admin.put_heatmap(hm))
                if self.out_dir is not None:
                    write_files(hm, cells, self.out_dir)
        summary = {
            "topic": self.topic,
            "batch": batch,
            "end": end,
            "windows": [[e - self.windows.window_ms, e] for e in plan.ends],
            "cells": len(maps[end][0].cells.h3),
            "pings": int(maps[end][0].source_pings),
            "new_pings": new.num_rows,
            "late": plan.late,
            "too_late": plan.too_late,
            "applied_index": max(indexes),
            "seconds": round(time.monotonic() - t0, 2),
        }
        keep = end - self.windows.lateness_ms - self.history_ms
        self.history.done(batch, summary, keep)
        if self.metrics is not None and before is None:
            m = self.metrics
            m.pings.labels(self.topic).inc(new.num_rows)
            m.late.labels(self.topic).inc(plan.late)
            m.too_late.labels(self.topic).inc(plan.too_late)
            m.windows.labels(self.topic).inc(len(plan.ends))
            m.seconds.labels(self.topic).set(time.monotonic() - t0)
        if self.metrics is not None:
            self.metrics.committed(self.topic, end)
        self.report(summary)

    def compute(self, ends: list[int]) -> dict[int, tuple[heatmaps_pb2.HeatMap, pa.Table]]:
        """The heat map of each window ending at ``ends``, by ``transform``
        over the pings of ``[end - history, end)``, as the batch job."""
        rows = self.history.between(min(ends) - self.history_ms, max(ends))
        df = self.spark.createDataFrame(rows)
        parts = []
        for e in ends:
            hist = df.filter((F.col("ts_ms") >= e - self.history_ms) & (F.col("ts_ms") < e))
            out = transform(
                hist, self.spec.h3_resolution, e - self.windows.window_ms, e,
                self.spec.region_geojson,
            )  # fmt: skip
            parts.append(out.withColumn("window_end_ms", F.lit(e)))
        table = reduce(DataFrame.unionByName, parts).toArrow()
        which = table.column("window_end_ms").to_numpy(zero_copy_only=False)
        result = {}
        for e in ends:
            mine = table.filter(pa.array(which == e)).drop_columns(["window_end_ms"])
            result[e] = to_heatmap(
                mine, self.topic, self.spec.h3_resolution, self.bbox,
                e - self.windows.window_ms, e,
            )  # fmt: skip
        return result


def start(
    spark: SparkSession,
    *,
    topic: str,
    nodes: list[str],
    servers: list[str],
    secret_file: Path | None,
    cluster_name: str,
    checkpoint: Path,
    windows: Windows,
    history_ms: int = DEFAULT_HISTORY_MS,
    out_dir: Path | None = None,
    once: bool = False,
    metrics: Metrics | None = None,
    report: Callable[[dict[str, Any]], None] = lambda summary: None,
    clock: Callable[[], float] = time.time,
) -> StreamingQuery:
    """Start the query (``once``: what is there now, then stop)."""
    job = StreamJob(
        spark, topic, servers, checkpoint, windows, history_ms, out_dir, metrics, clock, report
    )
    starting = int(clock() * 1000) - history_ms - windows.lateness_ms - START_LEAD_MS
    df = (
        spark.readStream.format("roadlog")
        .schema(", ".join(f"{c} {SPARK_TYPES[c]}" for c in COLUMNS))  # the source prunes to them
        .option("nodes", ",".join(nodes))
        .option("secret_file", str(secret_file or ""))
        .option("cluster_name", cluster_name)
        .option("topic", topic)
        .option("starting", str(max(0, starting)))
        .option("tick_ms", str(windows.every_ms))
        .load()
    )
    writer = df.writeStream.foreachBatch(job.process).option(
        "checkpointLocation", str(checkpoint / "spark")
    )
    if once:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{windows.every_ms} milliseconds")
    return writer.queryName(f"roadlog-heatmap-{topic}").start()


def run_until_stopped(query: StreamingQuery, say: Callable[[str], None] = log.info) -> None:
    """Wait for the query (its failure raised); on SIGINT or SIGTERM stop it
    between triggers, not in the middle of one (a second signal does not
    wait). A trigger stopped midway is harmless, only noisy: it runs again
    on restart. Must run in the main thread (signal handlers)."""
    signals: list[int] = []

    def note(signum: int, frame: Any) -> None:
        signals.append(signum)

    before = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while query.isActive and not signals:
            time.sleep(0.5)
        if signals and query.isActive:
            say("stopping after the current trigger (Ctrl-C again: now)")
            deadline = time.monotonic() + 300
            while query.isActive and query.status.get("isTriggerActive"):
                if len(signals) > 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            query.stop()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    query.awaitTermination()  # raises what stopped a failed query


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--topic", required=True)
    ap.add_argument("--nodes", required=True, help="node gRPC HOST:PORT,...")
    ap.add_argument("--servers", required=True, help="queue server HOST:PORT,...")
    ap.add_argument(
        "--secret-file", type=Path, help="the cluster secret (only without TLS: with TLS the "
        "client certificate in ROADLOG_CERT_FILE/ROADLOG_KEY_FILE is the credential)",
    )  # fmt: skip
    ap.add_argument("--cluster-name", default="roadlog")
    ap.add_argument("--every-ms", type=int, default=DEFAULT_EVERY_MS)
    ap.add_argument("--window-ms", type=int, default=DEFAULT_WINDOW_MS)
    ap.add_argument("--lateness-ms", type=int, default=DEFAULT_LATENESS_MS)
    ap.add_argument("--history-ms", type=int, default=DEFAULT_HISTORY_MS)
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--out", type=Path, help="also write each window's files here")
    ap.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    ap.add_argument("--once", action="store_true", help="what is there now, then stop")
    return ap


def main(argv: list[str] | None = None) -> int:
    from spark.jobs.heatmap import AlreadyRunning, lock

    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        held = lock(args.checkpoint / "stream.lock")
    except AlreadyRunning as e:
        print(f"not running: {e}", file=sys.stderr)
        return 1
    metrics = Metrics()
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    spark = session(args.master, app="roadlog-heatmap-stream")
    try:
        query = start(
            spark,
            topic=args.topic,
            nodes=args.nodes.split(","),
            servers=args.servers.split(","),
            secret_file=args.secret_file,
            cluster_name=args.cluster_name,
            checkpoint=args.checkpoint,
            windows=Windows(args.every_ms, args.window_ms, args.lateness_ms),
            history_ms=args.history_ms,
            out_dir=args.out,
            once=args.once,
            metrics=metrics,
            report=lambda s: print(json.dumps(s), flush=True),
        )
        run_until_stopped(query)
    finally:
        spark.stop()
        held.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
