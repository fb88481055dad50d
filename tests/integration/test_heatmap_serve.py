"""The warm heat-map job server (``roadlog heatmap serve``, a real process
with its own Spark session) against a real cluster with TLS and tokens:
``heatmap build`` through it gives the same map as building without it
(and builds without it when none answers); a stranger's job (no token, a
wrong one) is refused and runs nothing; /metrics and /healthz answer."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from roadlog.client import Admin, Connection, Producer
from roadlog.geo import bbox_region, parse_region
from roadlog.runtime.processes import free_port
from roadlog.tools.localcluster import LocalCluster
from roadlog.tools.traffic import TrafficSpec, simulate
from tests.certs import ClusterCA
from tests.integration.test_replicated_log import digest
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

REGION = bbox_region(11.45, 48.08, 11.70, 48.20)
ROADLOG = [sys.executable, "-m", "roadlog.cli"]


def ask(
    lc: LocalCluster, port: int, method: str, path: str, body: Any = None, token: str | None = None
) -> tuple[int, str]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=300, context=lc.ssl_context())
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, test_ca: ClusterCA
) -> Iterator[tuple[LocalCluster, int, int]]:
    """One node holding 2 minutes of 60 vehicles: (cluster, window start, end)."""
    lc = LocalCluster.create(Path(tmp_path_factory.mktemp("hs")) / "c", 1, 1, ca=test_ca.signing)
    lc.start_all()
    try:
        lc.wait_ready(60)
        end = int(time.time() * 1000)
        with Connection(lc.servers, tls=lc.tls()) as conn:
            Admin(conn).create_topic("munich", REGION.geojson, 4)
            p = Producer(conn, "munich")
            spec = TrafficSpec(vehicles=60, duration_s=120, end_ms=end, seed=7)
            for cols in simulate(parse_region(REGION.geojson), spec):
                p.send_batch(cols)
            written = conn.fence
        wait_for(lambda: int(digest(lc.nodes[0].address)[0]) >= written, 60, "the node to apply")
        yield lc, end - 121_000, end + 1
    finally:
        lc.down(grace=1)


@pytest.fixture(scope="module")
def server(
    cluster: tuple[LocalCluster, int, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[int, Path]]:
    """``heatmap serve`` of the cluster, answering: (its port, its --out)."""
    lc = cluster[0]
    port, out = free_port(), Path(tmp_path_factory.mktemp("served"))
    log = open(out / "serve.log", "w")  # noqa: SIM115 - the process's
    proc = subprocess.Popen(
        [*ROADLOG, "heatmap", "serve", "--cluster", str(lc.dir), "--listen",
         f"127.0.0.1:{port}", "--out", str(out / "maps")],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
    )  # fmt: skip

    def ready() -> bool:
        assert proc.poll() is None, (out / "serve.log").read_text()
        try:
            status, body = ask(lc, port, "GET", "/healthz")
        except OSError:
            return False
        return status == 200 and json.loads(body)["ready"]

    try:
        wait_for(ready, 240, "the job server's health check", every=0.5)
        yield port, out
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def build(lc: LocalCluster, start: int, end: int, out: Path, job_server: str) -> dict[str, Any]:
    done = subprocess.run(
        [*ROADLOG, "heatmap", "build", "munich", "--window", f"{start},{end}", "--json",
         "--out", str(out), "--job-server", job_server, "--cluster", str(lc.dir)],
        env=dict(os.environ), timeout=600, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


def test_a_build_through_the_server_equals_one_without_it(
    cluster: tuple[LocalCluster, int, int], server: tuple[int, Path], tmp_path: Path
) -> None:
    lc, start, end = cluster
    port, served_out = server
    warm = build(lc, start, end, tmp_path / "here", f"127.0.0.1:{port}")
    assert warm["server"] == f"127.0.0.1:{port}"
    assert Path(warm["dir"]).is_relative_to(served_out / "maps")  # the server's files
    nobody = free_port()  # nothing listens there: built here, as before the server
    cold = build(lc, start, end, tmp_path / "here", f"127.0.0.1:{nobody}")
    assert "server" not in cold and Path(cold["dir"]).is_relative_to(tmp_path / "here")
    assert warm["cells"] == cold["cells"] > 20 and warm["pings"] == cold["pings"] > 1000
    a = pq.read_table(Path(warm["dir"]) / "cells.parquet").to_pylist()
    b = pq.read_table(Path(cold["dir"]) / "cells.parquet").to_pylist()
    assert a == b  # cell by cell, every figure
    status, text = ask(lc, port, "GET", "/metrics")
    assert status == 200
    assert 'roadlog_heatmap_server_jobs_total{outcome="ok",topic="munich"} 1.0' in text


def test_a_strangers_job_is_refused_and_runs_nothing(
    cluster: tuple[LocalCluster, int, int], server: tuple[int, Path]
) -> None:
    lc, start, end = cluster
    port, _ = server
    job = {"topic": "munich", "window_start_ms": start, "window_end_ms": end}
    before = ask(lc, port, "GET", "/metrics")[1]
    assert ask(lc, port, "POST", "/jobs", job)[0] == 401
    assert ask(lc, port, "POST", "/jobs", job, token="not-the-token")[0] == 401
    with Connection(lc.servers, tls=lc.tls()) as conn:  # an identity of the cluster, not the job's
        other = Admin(conn).create_client("carol", ["heatmap:munich"]).token
    assert ask(lc, port, "POST", "/jobs", job, token=other)[0] == 401
    status, body = ask(lc, port, "POST", "/jobs", {"topic": "munich"}, token=lc.spark_token)
    assert status == 400 and "window_start_ms" in body  # the token, but no job
    after = ask(lc, port, "GET", "/metrics")[1]
    assert 'roadlog_heatmap_server_refused_total{reason="wrong_token"} 2.0' in after
    assert 'roadlog_heatmap_server_refused_total{reason="no_token"} 1.0' in after
    jobs = [ln for ln in after.splitlines() if ln.startswith("roadlog_heatmap_server_jobs_total")]
    assert jobs == [
        ln for ln in before.splitlines() if ln.startswith("roadlog_heatmap_server_jobs_total")
    ]
