"""Heat maps end to end: simulated traffic with a known jam, read from a
real cluster by the Spark data source, built, committed, served under
give-to-get, rendered; the same job on a standalone master and worker; the
HTML page in headless Chromium."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import h3
import numpy as np
import pytest

from roadlog.client import Admin, Connection, PermissionDenied, Producer
from roadlog.geo import bbox_region, parse_region
from roadlog.tools.localcluster import LocalCluster
from roadlog.tools.traffic import TrafficSpec, simulate
from spark.jobs.heatmap import AlreadyRunning, lock, main, run
from spark.roadlog_source import plan, read_range
from spark.standalone import local_standalone
from tests.certs import ClusterCA
from tests.integration.conftest import (
    SMALL_PINGS,
    SMALL_SECONDS,
    contribute,
    headless_chromium,
    settled,
    wait_for,
)
from tests.integration.test_replicated_log import digest

pytestmark = pytest.mark.integration

REGION = bbox_region(11.45, 48.08, 11.70, 48.20)
HOT = (11.575, 48.137)  # lon, lat
# The traffic's identities (made by the fixture): alice sends the pings,
# bob only asks for heat maps.
TOKENS: dict[str, str] = {}


def as_(lc: LocalCluster, who: str) -> Connection:
    """A connection of identity ``who``."""
    return Connection(lc.servers, tls=lc.tls().with_token(TOKENS[who]))


@pytest.fixture
def spark_identity(
    traffic: tuple[LocalCluster, int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-process Spark job's connections carry the cluster's Spark
    identity (ROADLOG_TOKEN, as ``roadlog heatmap build`` sets it)."""
    token = traffic[0].spark_token
    assert token
    monkeypatch.setenv("ROADLOG_TOKEN", token)


def metres(a: tuple[float, float], b: tuple[float, float]) -> float:
    dx = (a[0] - b[0]) * 111_320 * math.cos(math.radians(b[1]))
    return math.hypot(dx, (a[1] - b[1]) * 111_320)


@pytest.fixture(scope="module")
def traffic(
    tmp_path_factory: pytest.TempPathFactory, test_ca: ClusterCA
) -> Iterator[tuple[LocalCluster, int, int, int]]:
    """A cluster holding 3 minutes of 150 vehicles with a jam at HOT (the
    window), and an hour-old burst outside it."""
    lc = LocalCluster.create(Path(tmp_path_factory.mktemp("hm")) / "c", 3, 1, ca=test_ca.signing)
    lc.start_all()
    try:
        lc.wait_ready(60)
        with Connection(lc.servers, tls=lc.tls()) as conn:
            admin = Admin(conn)
            admin.create_topic("munich", REGION.geojson, 4, contribution_min_pings=SMALL_PINGS,
                               contribution_min_seconds=SMALL_SECONDS)  # fmt: skip
            TOKENS["alice"] = admin.create_client(
                "alice", ["produce:munich", "heatmap:munich"]
            ).token
            TOKENS["bob"] = admin.create_client("bob", ["heatmap:munich"]).token
        end = int(time.time() * 1000)
        spec = TrafficSpec(vehicles=150, duration_s=180, end_ms=end, hotspots=(HOT,), seed=5)
        region = parse_region(REGION.geojson)
        in_window = 0
        with as_(lc, "alice") as conn:
            p = Producer(conn, "munich")
            for cols in simulate(region, spec):
                p.send_batch(cols)
                in_window += len(cols)
            old = TrafficSpec(vehicles=20, duration_s=30, end_ms=end - 3_600_000, seed=6)
            burst = list(simulate(region, old))
            # The burst, sent over SMALL_SECONDS at least (again if it is
            # sent sooner: outside the window, it counts in no map), makes
            # alice a contributor (issue 39).
            contribute(lambda k: p.send_batch(burst[k % len(burst)]))
            written = conn.fence
        # The Spark source plans its read on one node at that node's applied
        # index, and takes no fence: wait until every node has applied all
        # that was published, or a node behind would plan too few pings.
        wait_for(
            lambda: all(int(digest(n.address)[0]) >= written for n in lc.nodes),
            30,
            "every node to apply the published traffic",
        )
        start = end - 180_000 - 1000
        yield lc, start, end + 1, in_window
    finally:
        lc.down(grace=1)


def build(
    lc: LocalCluster, start: int, end: int, out: Path, master: str = "local[2]"
) -> dict[str, object]:
    return run(
        topic="munich",
        nodes=[n.address for n in lc.nodes],
        servers=lc.servers,
        secret_file=None,  # with TLS the reader's client certificate is its credential
        cluster_name="roadlog",
        window_start_ms=start,
        window_end_ms=end,
        master=master,
        out_dir=out,
    )


@pytest.fixture(scope="module")
def first_map(
    traffic: tuple[LocalCluster, int, int, int], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, object]:
    """The window's heat map, built once (with the cluster's Spark identity)
    for the tests that look at a build's result, not at building again."""
    lc, start, end, _ = traffic
    assert lc.spark_token
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROADLOG_TOKEN", lc.spark_token)
        return build(lc, start, end, tmp_path_factory.mktemp("first-map"))


def test_the_data_source_reads_committed_data_the_same_twice(
    traffic: tuple[LocalCluster, int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    lc, start, end, n = traffic
    options = {
        "nodes": ",".join(n.address for n in lc.nodes),
        "topic": "munich",
        "window_start_ms": str(start),
        "window_end_ms": str(end),
        "max_pings_per_task": "2000",
    }
    tasks = plan(options)
    assert len(tasks) > 4  # split by partition and by size

    def rows() -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for t in tasks:
            for rb in read_range(t):
                out += list(
                    zip(
                        rb.column("partition").to_pylist(),
                        rb.column("offset").to_pylist(),
                        strict=True,
                    )
                )
        return out

    first = rows()
    assert len(first) == n == len(set(first))  # the window only, each ping once
    assert rows() == first
    # A reader without a client certificate of the cluster's CA gets nowhere
    # (no cluster secret is needed, nor would one help).
    monkeypatch.delenv("ROADLOG_CERT_FILE")
    monkeypatch.delenv("ROADLOG_KEY_FILE")
    with pytest.raises(RuntimeError):
        plan({**options, "secret_file": lc.secret_file})


def test_the_jobs_own_read_gives_the_cells_the_source_gives(
    traffic: tuple[LocalCluster, int, int, int], spark_identity: None
) -> None:
    """``transform_source`` (the planned partitions read in the job's own
    tasks, the pings never JVM rows) equals ``transform`` over
    ``spark.read.format("roadlog")`` of the same options, cell by cell."""
    from roadlog.v1 import client_pb2
    from spark.cell_buckets import PING_COLUMNS
    from spark.jobs.heatmap import read_options, session, transform, transform_source
    from spark.roadlog_source import RoadlogReader

    lc, start, end, n = traffic
    with Connection(lc.servers, tls=lc.tls()) as conn:
        spec = Admin(conn).describe("munich").topic.spec
        fences = conn.call("ReadFences", client_pb2.ReadFencesRequest(topic="munich"), timeout=30)
    options = read_options(topic="munich", nodes=[x.address for x in lc.nodes], fences=fences,
                           secret_file=None, cluster_name="roadlog", start_ms=start - 7_200_000,
                           end_ms=end)  # fmt: skip
    spark = session("local[2]", "roadlog-read-paths")
    try:
        df = spark.read.format("roadlog").schema(
            ", ".join(f"{c} {t}" for c, t in (("device_id", "string"), ("ts_ms", "long"),
                      ("lat", "double"), ("lon", "double"), ("speed_mps", "float")))
        )  # fmt: skip
        via_source = transform(
            df.options(**options).load(), spec.h3_resolution, start, end, spec.region_geojson
        ).collect()
        own = transform_source(
            spark, RoadlogReader(options, PING_COLUMNS), spec.h3_resolution, start, end,
            spec.region_geojson,
        ).collect()  # fmt: skip
    finally:
        spark.stop()
    a = sorted((r.asDict() for r in via_source), key=lambda r: r["h3"])
    b = sorted((r.asDict() for r in own), key=lambda r: r["h3"])
    assert [(r["h3"], r["pings"], r["devices"]) for r in a] == [
        (r["h3"], r["pings"], r["devices"]) for r in b
    ]
    for x, y in zip(a, b, strict=True):  # float sums in another order: to the last bits
        for k in ("mean_speed_mps", "free_flow_mps", "congestion"):
            assert x[k] == pytest.approx(y[k], rel=1e-9, abs=1e-12), (x, y)
    assert len(a) > 50 and sum(r["pings"] for r in a) == n


def test_the_jam_shows_up_where_it_is_and_only_contributors_see_it(
    traffic: tuple[LocalCluster, int, int, int],
    first_map: dict[str, object],
    tmp_path: Path,
    spark_identity: None,
) -> None:
    lc, start, end, n = traffic
    summary = first_map
    assert summary["pings"] == n  # the old burst is outside the window
    with as_(lc, "alice") as conn:
        conn.fence = int(str(summary["applied_index"]))  # read at the map's store, not before
        got = Admin(conn).heatmap("munich")
    with as_(lc, "bob") as conn:  # bob may ask for heat maps, but sent nothing
        conn.fence = int(str(summary["applied_index"]))
        with pytest.raises(PermissionDenied):
            Admin(conn).heatmap("munich", client="alice")  # naming alice changes nothing
    c = got.heatmap.cells
    assert len(c.h3) > 20 and sum(c.pings) == n
    busy = [i for i in range(len(c.h3)) if c.pings[i] >= np.percentile(list(c.pings), 75)]
    worst = sorted(busy, key=lambda i: c.congestion[i], reverse=True)[:3]
    for i in worst:
        lat, lon = h3.cell_to_latlng(h3.int_to_str(c.h3[i]))
        assert metres((lon, lat), HOT) < 800, (lat, lon)  # the jam, not elsewhere
    far = [
        i for i in range(len(c.h3))
        if metres(tuple(reversed(h3.cell_to_latlng(h3.int_to_str(c.h3[i])))), HOT) > 2500
    ]  # fmt: skip
    assert far and np.mean([c.congestion[i] for i in far]) < 0.3  # traffic flows elsewhere
    where = Path(str(summary["dir"]))
    for name in ("cells.parquet", "heatmap.geojson", "heatmap.png", "heatmap.html"):
        assert (where / name).stat().st_size > 1000, name
    assert (where / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Re-running the window replaces its result; it never doubles it.
    again = build(lc, start, end, tmp_path)
    assert again["pings"] == n
    with as_(lc, "alice") as conn:
        conn.fence = int(str(again["applied_index"]))  # read at the new map's store
        resp = Admin(conn).heatmap("munich")
    assert list(resp.windows) == [start] and sum(resp.heatmap.cells.pings) == n


def test_a_cron_run_finds_the_previous_one_running_and_exits_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "job.lock"
    held = lock(path)
    try:
        with pytest.raises(AlreadyRunning):
            lock(path)
        rc = main(
            ["--topic", "x", "--nodes", "127.0.0.1:1", "--servers", "127.0.0.1:1",
             "--secret-file", str(path), "--lock", str(path)]
        )  # fmt: skip
        assert rc == 0
    finally:
        held.close()


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[str]:
    """A Spark standalone master and one worker on 127.0.0.1."""
    with local_standalone(tmp_path) as url:
        yield url


def test_the_same_job_runs_on_a_standalone_cluster(
    traffic: tuple[LocalCluster, int, int, int],
    standalone: str,
    tmp_path: Path,
    spark_identity: None,
) -> None:
    lc, start, end, n = traffic
    summary = build(lc, start, end, tmp_path, master=standalone)
    assert summary["pings"] == n and int(str(summary["cells"])) > 20


def test_the_html_page_draws_in_headless_chromium(
    first_map: dict[str, object], tmp_path: Path
) -> None:
    summary = first_map
    page = Path(str(summary["dir"])) / "heatmap.html"
    with headless_chromium(1200, 1000) as driver:
        driver.get(page.as_uri())
        wait_for(lambda: driver.execute_script("return document.body.dataset.cells") is not None,
                 30, "the page to draw")  # fmt: skip
        drawn = int(driver.execute_script("return document.body.dataset.cells"))
        assert drawn == int(str(summary["cells"]))
        painted = driver.execute_script(
            "const c = document.getElementById('map');"
            "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n;"
        )
        assert painted > 10_000  # cells were filled, not an empty canvas
        shot = tmp_path / "heatmap-screenshot.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        logs = driver.get_log("browser")
        errors = [e for e in logs if e["level"] == "SEVERE"]
        assert errors == []


def test_the_cli_builds_and_gets(
    traffic: tuple[LocalCluster, int, int, int], tmp_path: Path
) -> None:
    lc, start, end, _ = traffic
    env = dict(os.environ)
    roadlog = [sys.executable, "-m", "roadlog.cli"]
    where = ["--cluster", str(lc.dir)]
    alice, bob = ["--token", TOKENS["alice"]], ["--token", TOKENS["bob"]]
    subprocess.run(
        [*roadlog, "heatmap", "build", "munich", "--window", f"{start},{end}",
         "--out", str(tmp_path / "maps"), *where],
        check=True, env=env, timeout=300,
    )  # fmt: skip

    # `heatmap get` has no fence option: until the node that answers has
    # applied the map the build stored, it has none to give (NOT_FOUND).
    def get() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*roadlog, "heatmap", "get", "munich", "--png", str(tmp_path / "m.png"),
             "--html", str(tmp_path / "m.html"), "--geojson", str(tmp_path / "m.geojson"),
             *where, *alice],
            env=env, timeout=120, capture_output=True, text=True,
        )  # fmt: skip

    out = settled(get, lambda r: r.returncode == 0, "the built heat map served to the CLI")
    assert (tmp_path / "m.png").stat().st_size > 1000 and "cells" in out.stderr
    denied = subprocess.run(
        [*roadlog, "heatmap", "get", "munich", "--json", *where, *bob],
        env=env, timeout=120, capture_output=True, text=True,
    )  # fmt: skip
    assert denied.returncode != 0 and "not allowed" in denied.stderr
