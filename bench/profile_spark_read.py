"""Where the seconds of a read through ``spark.read.format("roadlog")`` go:
one node (TLS, tokens, ``--data-groups``), ``--pings`` pings, then the same
plan read stage by stage, each stage adding one hop:

- ``wire``: the tasks' ``ReadRange`` streams read by two processes (as
  local[2] runs two tasks at once), the bytes only (the node and gRPC/TLS);
- ``arrow``: the same through ``read_range`` (decode and Arrow batches:
  what a Spark Python worker runs);
- ``spark_count`` / ``spark_every`` / ``spark_two``: Spark local[2] through
  the source: a count, every column (a mean of each numeric column and a
  distinct count of devices) and two columns (count and mean speed);
- ``parquet_*``: the same queries over a Parquet copy of the rows.

Each stage: wall seconds, and the CPU seconds of the node process and of
this process's children (the Spark JVM and its Python workers, or the two
readers). ``--repeats`` rounds, stages alternated; medians. ``--py-spy
DIR``: py-spy samples the node (and, in the Spark stages, the Python
workers) into DIR/<stage>-<process>.txt (raw stacks).

    python -m bench.profile_spark_read --pings 2000000 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.spark_heatmap import NUMERIC, REGION, TOPIC, deployed_env, load, say
from roadlog.client import Admin, Connection
from roadlog.tools.localcluster import LocalCluster

CLK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of a process and its waited-for children, seconds."""
    f = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(x) for x in f[11:15]) / CLK


def tree_cpu_s(root: int) -> float:
    """CPU seconds of every living process under ``root`` (not itself),
    plus what the dead ones left in their parents' counters."""
    total = 0.0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == root:
            total += cpu_s(int(d.name)) + tree_cpu_s(int(d.name))
    return total


def _warm(_: int) -> None:
    import spark.roadlog_source  # noqa: F401 - the imports, before the clock starts


def _read_tasks(args: tuple[list[Any], str]) -> tuple[int, int]:
    """Read tasks in a fresh process: (pings or bytes, batches)."""
    tasks, how = args
    from roadlog.client_tls import ClientTLS
    from roadlog.runtime.auth import token_metadata
    from roadlog.v1 import noderead_pb2, noderead_pb2_grpc
    from spark.roadlog_source import GRPC_OPTIONS, read_range

    total = batches = 0
    for t in tasks:
        if how == "arrow":
            for rb in read_range(t):
                total += rb.num_rows
                batches += 1
            continue
        req = noderead_pb2.ReadRangeRequest(
            topic=t.topic, partition=t.partition, start_offset=t.start, end_offset=t.end,
            min_applied_index=t.fence, group=t.group,
        )  # fmt: skip
        with ClientTLS.from_env().channel(t.nodes[0], options=GRPC_OPTIONS) as ch:
            for b in noderead_pb2_grpc.NodeReadStub(ch).ReadRange(
                req, metadata=token_metadata(t.token), timeout=600
            ):
                total += len(b.batch)
                batches += 1
    return total, batches


class Stages:
    def __init__(self, node_pid: int, spy: Path | None) -> None:
        self.node_pid = node_pid
        self.spy = spy
        self.results: dict[str, list[dict[str, float]]] = {}

    def time(self, name: str, fn: Callable[[], Any], workers: Callable[[], list[int]]) -> Any:
        spies = []
        if self.spy is not None:
            spies.append(self._spy(name, "node", [self.node_pid]))
        n0, c0 = cpu_s(self.node_pid), tree_cpu_s(os.getpid()) + cpu_s(os.getpid())
        t0 = time.monotonic()
        if self.spy is not None and workers():
            spies.append(self._spy(name, "workers", workers()))
        out = fn()
        wall = time.monotonic() - t0
        n1, c1 = cpu_s(self.node_pid), tree_cpu_s(os.getpid()) + cpu_s(os.getpid())
        for p in spies:
            p.terminate()
            p.wait(30)
        r = {"wall_s": wall, "node_cpu_s": n1 - n0, "client_cpu_s": c1 - c0}
        self.results.setdefault(name, []).append(r)
        say(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()) + f" -> {out}")
        return out

    def _spy(self, stage: str, what: str, pids: list[int]) -> subprocess.Popen[bytes]:
        assert self.spy is not None
        pyspy = shutil.which("py-spy") or "/tmp/pyspy/bin/py-spy"
        out = self.spy / f"{stage}-{what}.txt"
        argv = [pyspy, "record", "--format", "raw", "--rate", "100", "--nonblocking",
                "-o", str(out), "--subprocesses", "--pid", str(pids[0])]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": "/tmp/pyspy"}
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

    def summary(self) -> dict[str, dict[str, Any]]:
        return {
            name: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}
            | {
                "wall_s_spread": [
                    round(min(r["wall_s"] for r in rs), 2),
                    round(max(r["wall_s"] for r in rs), 2),
                ]
            }
            for name, rs in self.results.items()
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pings", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data-groups", type=int, default=1)
    ap.add_argument("--stages", default="wire,arrow,spark_count,spark_every,spark_two,parquet")
    ap.add_argument("--py-spy", type=Path, help="sample with py-spy into this folder")
    ap.add_argument("--json", type=Path, help="write the medians here")
    args = ap.parse_args(argv)
    want = set(args.stages.split(","))
    if args.py_spy:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="roadlog-spark-profile-", dir="/var/tmp"))
    lc = LocalCluster.create(work / "cluster", 1, 1, data_groups=args.data_groups)
    lc.start_all()
    try:
        lc.wait_ready(60)
        deployed_env(lc)
        end = int(time.time() * 1000)
        with Connection(lc.servers, timeout=120, tls=lc.tls()) as conn:
            Admin(conn).create_topic(TOPIC, REGION.geojson, 8)
        t0 = time.monotonic()
        load(lc, 0, args.pings, end)
        say(f"loaded {args.pings:,} pings in {time.monotonic() - t0:.0f} s")
        figures = profile(lc, end, work, args, want)
    finally:
        lc.down(grace=3)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def profile(
    lc: LocalCluster, end: int, work: Path, args: argparse.Namespace, want: set[str]
) -> dict[str, Any]:
    from pyspark.sql import functions as F

    from spark.jobs.heatmap import session
    from spark.roadlog_source import plan

    node_pid = lc.nodes[0].pid
    assert node_pid
    options = {
        "nodes": ",".join(n.address for n in lc.nodes),
        "topic": TOPIC,
        "window_start_ms": str(end - 600_000),
        "window_end_ms": str(end + 1),
    }
    tasks = plan(options)
    say(f"{len(tasks)} tasks")
    st = Stages(node_pid, args.py_spy)
    halves = [tasks[0::2], tasks[1::2]]
    ctx = mp.get_context("spawn")
    spark = session("local[2]", "roadlog-read-profile") if want - {"wire", "arrow"} else None

    def workers() -> list[int]:
        """The Spark Python workers' daemon (forked from the JVM)."""
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if b"pyspark.daemon" in (d / "cmdline").read_bytes():
                        out.append(int(d.name))
                except OSError:
                    pass
        return sorted(out)[:1]

    def source(schema: str | None = None) -> Any:
        assert spark is not None
        r = spark.read.format("roadlog")
        if schema:
            r = r.schema(schema)
        for k, v in options.items():
            r = r.option(k, v)
        return r.load()

    every = [*(F.avg(c) for c in NUMERIC), F.countDistinct("device_id"), F.count(F.lit(1))]
    two = [F.count(F.lit(1)), F.avg("speed_mps")]
    pq_path = str(work / "pings.parquet")
    if spark is not None and "parquet" in want:
        source().write.mode("overwrite").parquet(pq_path)
    try:
        for _ in range(args.repeats):
            for how in ("wire", "arrow"):
                if how in want:
                    with ctx.Pool(2) as pool:
                        pool.map(_warm, [0, 1])
                        st.time(how, lambda h=how, p=pool: [  # type: ignore[misc]
                            x for x in p.map(_read_tasks, [(t, h) for t in halves])
                        ], lambda: [])  # fmt: skip
            if spark is None:
                continue
            two_schema = os.environ.get("PROFILE_TWO_SCHEMA", "speed_mps float") or None
            frames: list[tuple[str, Callable[[], Any], list[Any]]] = [
                ("spark_count", source, [F.count(F.lit(1))]),
                ("spark_every", source, every),
                ("spark_two", lambda s=two_schema: source(s), two),  # type: ignore[misc]
                ("parquet_every", lambda: spark.read.parquet(pq_path), every),
                ("parquet_two", lambda: spark.read.parquet(pq_path), two),
            ]
            for name, df, aggs in frames:
                if name in want or name.split("_")[0] in want:
                    st.time(name, lambda d=df, a=aggs: d().agg(*a).collect()[0][-1], workers)  # type: ignore[misc]
    finally:
        if spark is not None:
            spark.stop()
    return {"pings": args.pings, "tasks": len(tasks), "stages": st.summary()}


if __name__ == "__main__":
    sys.exit(main())
