"""Cold start by discovery, on hosts made of network namespaces (needs root).

1. From the start of the last node to a ready cluster (one leader every
   node agrees on, every node in the configuration): 3 and 5 nodes started
   at once, median and max of ``--trials``.
2. A node joining a cluster that holds ``--gb`` GB of pings: from its start
   to being a voter (it is added as a learner, caught up by snapshot, then
   promoted).

Writes bench/results/discovery.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_result
from roadlog.client import Admin, Connection, Producer
from roadlog.client_tls import ClientTLS
from roadlog.columnar import PingColumns
from roadlog.geo import bbox_region
from tests.netns.conftest import Net, one_cluster, views

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson


def formation(nodes: int, trial: int) -> float:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        net = Net(Path(d), f"b{trial}{nodes}")
        net.create()
        try:
            hosts = [net.host(i) for i in range(1, nodes + 1)]
            for h in hosts:
                h.node(expect=nodes)
            t0 = time.monotonic()
            deadline = t0 + 120
            while not one_cluster(hosts, nodes, nodes):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no cluster of {nodes} after 120 s")
                time.sleep(0.05)
            return time.monotonic() - t0
        finally:
            net.destroy()


def batch(n: int, start: int) -> PingColumns:
    now = int(time.time() * 1000)
    return PingColumns.from_columns(
        [f"car-{i % 500}" for i in range(n)],
        now - 3_600_000 + np.arange(start, start + n),
        (48.1 + (np.arange(n) % 1000) * 1e-4).astype(np.float64),
        (11.5 + (np.arange(n) % 1000) * 1e-4).astype(np.float64),
        speed_mps=np.full(n, 8.0, dtype=np.float32),
    )


def join_with_data(gb: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        net = Net(Path(d), "bj")
        net.create()
        try:
            first, q = net.host(1), net.host(9)
            first.node(expect=1, extra=["--voters", "2", "--snapshot-entries", "2000"])
            q.spawn(
                "queue",
                [
                    sys.executable, "-m", "queue_server.main", "run",
                    "--cluster-name", "netns", "--listen", f"{q.ip}:7500",
                    "--secret-file", str(net.secret), "--metrics-port", "0",
                    "--discovery-broadcast", "10.77.0.255", "--insecure", "--client-auth", "none",
                ],
            )  # fmt: skip
            target = int(gb * 1e9)
            written = 0
            t_load = time.monotonic()
            with Connection([f"{q.ip}:7500"], timeout=120, tls=ClientTLS(insecure=True)) as conn:
                Admin(conn).create_topic("load", REGION, 8)
                p = Producer(conn, "load", client="bench")
                k = 0
                while written < target:
                    cols = batch(20_000, k * 20_000)
                    p.send_batch(cols)
                    written += len(cols) * 36
                    k += 1
                    if k % 50 == 0:
                        print(f"loaded {written / 1e9:.2f} GB", file=sys.stderr, flush=True)
            load_s = time.monotonic() - t_load
            joiner = net.host(2)
            t0 = time.monotonic()
            joiner.node(expect=1, extra=["--voters", "2"])
            while True:
                v = views([first, joiner])
                if len(v) == 2 and v[1].leader and v[2].id in set(v[1].voters):
                    break
                if time.monotonic() - t0 > 900:
                    raise TimeoutError("the joiner did not become a voter in 15 min")
                time.sleep(0.1)
            return {
                "gb": round(written / 1e9, 3),
                "load_s": round(load_s, 1),
                "to_voter_s": round(time.monotonic() - t0, 2),
            }
        finally:
            net.destroy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--gb", type=float, default=1.0)
    args = ap.parse_args(argv)
    forming: dict[str, Any] = {}
    for n in (3, 5):
        times = []
        for t in range(args.trials):
            times.append(formation(n, t))
            print(f"{n} nodes, trial {t + 1}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
        forming[str(n)] = {
            "trials": len(times),
            "median_s": round(statistics.median(times), 2),
            "max_s": round(max(times), 2),
        }
    join = join_with_data(args.gb)
    print(f"join with {join['gb']} GB: voter after {join['to_voter_s']} s", file=sys.stderr)
    print(write_result("discovery", {"formation": forming, "join": join}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
