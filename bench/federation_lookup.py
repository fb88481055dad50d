"""Federation's lookup cost (issue 43): on a local directory and two
one-node members, in alternated rounds of each, the milliseconds of

- ``lookup``: a topic's home asked of the directory (``LookupTopic``; what a
  client pays once per topic, then caches);
- ``direct``: a DescribeTopic on the topic's home (the call every later one
  costs the same as: the baseline);
- ``redirected``: the same DescribeTopic sent first to the other member,
  which names the home (FAILED_PRECONDITION, ``roadlog-topic-home``), the
  connection following it once (what a stale cache costs);
- ``search``: a member's one extra step on the hot path, the byte search of
  a PublishBatch answer of 1024 results for the node's "no topic" refusal
  (microseconds).

Each round opens fresh connections (so channel set-up counts in each kind
alike). Medians and the spread (min, max). Writes
bench/results/federation_lookup.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

from bench.common import write_result
from roadlog.client import Admin, Connection
from roadlog.federation.directory import Directory
from roadlog.geo import bbox_region
from roadlog.tools.localcluster import LocalCluster
from roadlog.tools.localdirectory import (
    directory_create,
    member_founding,
    wait_registered,
)
from roadlog.v1 import client_pb2


def _member(root: Path, dd: Path, name: str) -> LocalCluster:
    f = member_founding(dd, name, [f"region={name}"])
    lc = LocalCluster.create(
        root / name, 1, 1, extra_queue_args=f.queue_args, ca=f.ca, cluster_name=name
    )
    lc.start_all()
    lc.wait_ready(60, admin_token=f.admin_token)
    wait_registered(dd, name)
    return lc


def _ms(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def _search_us() -> float:
    resp = client_pb2.PublishBatchResponse()
    for i in range(1024):
        r = resp.results.add()
        r.response.offsets.add(partition=i % 8, base_offset=1_000_000 + i, count=100)
        r.response.applied_index = 123_456_789
    raw = resp.SerializeToString()
    n = 2000
    return min(timeit.repeat(lambda: b"no topic " in raw, number=n, repeat=5)) / n * 1e6


def run(rounds: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="fed-bench-"))
    dd = root / "dd"
    clusters: list[LocalCluster] = []
    try:
        d = directory_create(dd, 1)
        clusters.append(d)
        d.start_all()
        d.wait_ready(60)
        eu, us = _member(root, dd, "eu"), _member(root, dd, "us")
        clusters += [eu, us]
        with Directory(d.servers, tls=d.tls()) as fed:
            home = fed.place("denver", on="us")
            Admin(fed.member(home)).create_topic("denver", bbox_region(-105, 39, -104, 40).geojson)
        times: dict[str, list[float]] = {"lookup": [], "direct": [], "redirected": []}
        for _ in range(rounds):  # alternated: each kind in every round
            with Directory(d.servers, tls=d.tls()) as fresh:
                times["lookup"].append(_ms(lambda f=fresh: f.lookup("denver")))
            with Connection(us.servers, tls=us.tls()) as c:
                times["direct"].append(_ms(lambda c=c: Admin(c).describe("denver")))
            with Connection(eu.servers, tls=eu.tls()) as c:
                times["redirected"].append(_ms(lambda c=c: Admin(c).describe("denver")))
                assert c.cluster == "us"
        figures: dict[str, Any] = {"rounds": rounds}
        for kind, xs in times.items():
            figures[f"{kind}_ms"] = {
                "median": round(statistics.median(xs), 2),
                "min": round(min(xs), 2),
                "max": round(max(xs), 2),
            }
        figures["search_us_1024_results"] = round(_search_us(), 2)
        return figures
    finally:
        for lc in reversed(clusters):
            lc.down(grace=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    figures = run(ap.parse_args().rounds)
    print(figures)
    print(write_result("federation_lookup", figures))


if __name__ == "__main__":
    main()
