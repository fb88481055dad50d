"""The dashboard in a real browser (headless Chromium with selenium) against
a real cluster: the page loads with no console errors, draws a known jam's
cells where they are (the element under the jam's point on the screen is
the jam's cell, coloured as congested), follows a new heat map without a
reload, shows the cluster, and holds give-to-get with a client identity the
cluster issued: a token given in its fragment, or, with none, one it
registers for itself (POST /v1/clients) and keeps; a stranger (such a fresh
identity) is shown the 403's reason, and sees the map once it contributes.
The streaming heat map reaches an open page (how fast: bench/stream_delay.py).

Screenshots are saved under ``out/test-artifacts/``
(``ROADLOG_TEST_ARTIFACTS`` elsewhere)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h3
import numpy as np
import pytest

from roadlog.client import Admin, Connection, Producer
from roadlog.columnar import PingColumns
from roadlog.geo import bbox_region
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import heatmaps_pb2
from tests.certs import ClusterCA
from tests.integration.conftest import (
    SMALL_PINGS,
    SMALL_SECONDS,
    contribute,
    headless_chromium,
    wait_for,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("ROADLOG_TEST_ARTIFACTS", ROOT / "out" / "test-artifacts"))
REGION = bbox_region(11.45, 48.08, 11.70, 48.20)
HOT = (48.137, 11.575)  # lat, lon
CALM = (48.175, 11.48)
# A tile URL served by the queue server itself: tiles load with no internet.
TILES = "/ui/static/vendor/leaflet/images/layers.png?z={z}&x={x}&y={y}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, test_ca: ClusterCA) -> Iterator[LocalCluster]:
    lc = LocalCluster.create(
        Path(tmp_path_factory.mktemp("dash")) / "c", 3, 1,
        extra_queue_args=["--dashboard-tile-url", TILES], ca=test_ca.signing,
    )  # fmt: skip
    lc.start_all()
    try:
        lc.wait_ready(60)
        with Connection(lc.servers, tls=lc.tls()) as conn:
            Admin(conn).create_topic(
                "munich", REGION.geojson, 4,
                contribution_min_pings=SMALL_PINGS, contribution_min_seconds=SMALL_SECONDS,
            )  # fmt: skip
            now = int(time.time() * 1000)
            p = Producer(conn, "munich", client="alice")
            # The admin's page contributes (issue 39: a run of pings, not one).
            contribute(lambda k: p.send_batch(PingColumns.from_columns(
                [f"a{k}"], np.array([now]), np.array([HOT[0]]), np.array([HOT[1]]))))  # fmt: skip
        yield lc
    finally:
        lc.down(grace=1)


def cell(lat: float, lon: float) -> int:
    return int(h3.str_to_int(h3.latlng_to_cell(lat, lon, 9)))


def heat_map(start: int, jam: tuple[float, float]) -> heatmaps_pb2.HeatMap:
    """A jam around ``jam`` (congested in its middle) and flowing traffic at CALM."""
    hm = heatmaps_pb2.HeatMap(topic="munich", window_start_ms=start, window_end_ms=start + 900_000,
                              h3_resolution=9, computed_ms=int(time.time() * 1000),
                              bbox=list(REGION.bbox))  # fmt: skip
    centre = h3.latlng_to_cell(*jam, 9)
    figures: dict[int, tuple[float, float]] = {}
    for k in range(4):
        for c in h3.grid_ring(centre, k):
            figures[h3.str_to_int(c)] = (1.0 + 3 * k, 0.9 - 0.25 * k)  # speed, congestion
    for c in h3.grid_disk(h3.latlng_to_cell(*CALM, 9), 2):
        figures[h3.str_to_int(c)] = (13.0, 0.05)
    for h in sorted(figures):
        speed, congestion = figures[h]
        hm.cells.h3.append(h)
        hm.cells.pings.append(30)
        hm.cells.devices.append(6)
        hm.cells.mean_speed_mps.append(speed)
        hm.cells.free_flow_mps.append(14.0)
        hm.cells.congestion.append(max(congestion, 0.0))
    hm.source_pings = 30 * len(figures)
    return hm


def put(lc: LocalCluster, hm: heatmaps_pb2.HeatMap) -> None:
    with Connection(lc.servers, tls=lc.tls()) as conn:
        Admin(conn).put_heatmap(hm)


@pytest.fixture
def browser(cluster: LocalCluster) -> Iterator[Any]:
    """Over HTTPS: the browser accepts the queue server's certificate only."""
    q = cluster.queue_servers[0]
    assert q.http.startswith("https://")
    with headless_chromium(1400, 900, trust=Path(q.certs_dir) / "queue.crt") as driver:
        yield driver


def js(driver: Any, script: str) -> Any:
    return driver.execute_script(script)


def shot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    return path


def under(driver: Any, lat: float, lon: float) -> dict[str, str | None]:
    """The cell drawn at a point of the map, as the browser hit-tests it."""
    return dict(js(driver, f"""
        const d = window.roadlogDashboard, m = d.map;
        const p = m.latLngToContainerPoint([{lat}, {lon}]);
        const r = m.getContainer().getBoundingClientRect();
        const el = document.elementFromPoint(r.left + p.x, r.top + p.y);
        return {{h3: el && el.getAttribute('data-h3'), fill: el && el.getAttribute('fill')}};
    """))  # fmt: skip


def rgb(text: str | None) -> tuple[int, ...]:
    assert text and text.startswith("rgb("), text
    return tuple(int(x) for x in text[4:-1].split(","))


def test_the_page_shows_the_jam_where_it_is_and_follows_new_heat_maps(
    cluster: LocalCluster, browser: Any
) -> None:
    lc, driver = cluster, browser
    first = int(time.time() * 1000) // 60_000 * 60_000 - 900_000
    put(lc, heat_map(first, HOT))
    driver.get(f"{lc.queue_servers[0].http}/ui/?topic=munich#token={lc.admin_token}")
    wait_for(lambda: js(driver, "return document.body.dataset.window") == str(first), 30,
             "the page to draw the heat map")  # fmt: skip
    # the token given is the page's identity (kept, out of the address bar); none registered
    assert js(driver, "return document.body.dataset.identity") == "given"
    assert js(driver, "return localStorage.getItem('roadlog.token')") == lc.admin_token
    assert "token=" not in driver.current_url
    assert "admin" in js(driver, "return document.getElementById('identity').innerText")
    n = len(heat_map(first, HOT).cells.h3)
    assert js(driver, "return document.body.dataset.cells") == str(n)
    at_jam = under(driver, *HOT)
    assert at_jam["h3"] == h3.latlng_to_cell(*HOT, 9)  # the jam's cell, at the jam
    r, g, _ = rgb(at_jam["fill"])
    assert r > 180 and g < 100  # red: congested
    at_calm = under(driver, *CALM)
    assert at_calm["h3"] == h3.latlng_to_cell(*CALM, 9)
    r, g, _ = rgb(at_calm["fill"])
    assert g > r  # green: flowing
    # the tiles come from the configured URL, and the cluster panel is filled
    wait_for(lambda: js(driver, "return document.querySelectorAll('img.leaflet-tile-loaded')"
                                ".length") > 0, 30, "map tiles")  # fmt: skip
    src = js(driver, "return document.querySelector('img.leaflet-tile-loaded').src")
    assert "/ui/static/vendor/leaflet/images/layers.png?z=" in src
    wait_for(lambda: js(driver, "return document.querySelectorAll('#nodes tbody tr').length") == 3,
             30, "the cluster panel")  # fmt: skip
    panel = js(driver, "return document.getElementById('cluster').innerText")
    assert "leader" in panel and "munich" in panel and "127.0.0.1" in panel
    # each Raft group (here group 0 alone) with its leader and each replica's lag
    group_row = js(driver, "return document.querySelector('#groups tbody tr').innerText")
    assert group_row.startswith("0 (metadata)") and re.search(r"n1 \d+, n2 \d+, n3 \d+", group_row)
    tip = js(
        driver,
        f"""
        const c = window.roadlogDashboard.cells.get('{h3.latlng_to_cell(*HOT, 9)}');
        c.layer.fire('mouseover'); return document.getElementById('cell').innerText;""",
    )
    assert "congestion" in tip and "90 %" in tip
    shot(driver, "dashboard-jam.png")

    # A new heat map (the jam moved): drawn without a reload.
    js(driver, "window.__sameDocument = true")
    updates = int(js(driver, "return document.body.dataset.updates"))
    moved = (48.15, 11.62)
    put(lc, heat_map(first + 60_000, moved))
    wait_for(lambda: js(driver, "return document.body.dataset.window") == str(first + 60_000),
             30, "the page to follow the new heat map")  # fmt: skip
    assert js(driver, "return window.__sameDocument") is True
    assert int(js(driver, "return document.body.dataset.updates")) == updates + 1
    assert under(driver, *moved)["h3"] == h3.latlng_to_cell(*moved, 9)
    assert js(driver, "return document.getElementById('slider').max") == "1"  # two windows
    shot(driver, "dashboard-updated.png")
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


def page_identity(driver: Any) -> tuple[str, str]:
    """The client id the page shows and the token it keeps."""
    return (
        js(driver, "return document.body.dataset.client || ''"),
        js(driver, "return localStorage.getItem('roadlog.token') || ''"),
    )


def registrations(lc: LocalCluster) -> int:
    with Connection(lc.servers, tls=lc.tls()) as conn:
        return int(Admin(conn).list_clients().registered)


def test_a_page_without_a_token_registers_an_identity_and_is_shown_the_403(
    cluster: LocalCluster, browser: Any
) -> None:
    """A stranger: a page opened with no token registers an identity of its
    own (open self-registration), keeps it, lists the topics with it, and is
    shown the 403's reason for the heat map, not a blank map; once that
    identity publishes to the topic, the map appears (no reload)."""
    lc, driver = cluster, browser
    start = int(time.time() * 1000) // 60_000 * 60_000 - 900_000
    put(lc, heat_map(start, HOT))
    base = f"{lc.queue_servers[0].http}/ui/?topic=munich"
    registered = registrations(lc)
    driver.get(base)
    wait_for(lambda: js(driver, "return document.body.dataset.state") == "denied", 30,
             "the page to show the refusal")  # fmt: skip
    client, token = page_identity(driver)
    assert client.startswith("cl-") and token.startswith("rl_")
    assert js(driver, "return document.body.dataset.identity") == "registered"
    shown = js(driver, "return document.getElementById('identity').innerText")
    assert client in shown and "registered by this page" in shown
    # an identity the cluster issued (one more self-registered), a phone's scopes
    assert registrations(lc) == registered + 1
    scopes = js(driver, "return document.getElementById('identity').title")
    assert scopes == "scopes: heatmap:* produce:*"
    text = js(driver, "return document.getElementById('notice').innerText")
    assert "Not allowed" in text and "has not published pings to 'munich'" in text
    assert "#token=" in text  # how to see the map
    assert js(driver, "return window.roadlogDashboard.cells.size") == 0
    # the topics are listed with that identity (the cluster panel)
    wait_for(lambda: "munich" in js(driver, "return document.getElementById('topics').innerText"),
             30, "the topics listed for the page's identity")  # fmt: skip
    shot(driver, "dashboard-stranger.png")

    # Opened again: the same identity, not a new one.
    driver.get(base)
    wait_for(lambda: js(driver, "return document.body.dataset.state") == "denied", 30,
             "the reloaded page to show the refusal")  # fmt: skip
    assert page_identity(driver) == (client, token)
    assert registrations(lc) == registered + 1

    # The identity contributes (as the phone it is): the map appears, no reload.
    js(driver, "window.__sameDocument = true")
    with Connection(lc.servers, tls=lc.tls(), token=token) as conn:
        phone = Producer(conn, "munich")
        # a run of pings, as give-to-get counts (issue 39): the map comes only after it
        contribute(lambda k: phone.send_batch(PingColumns.from_columns(
            ["phone"], np.array([int(time.time() * 1000)]), np.array([HOT[0]]),
            np.array([HOT[1]]))))  # fmt: skip
    wait_for(lambda: js(driver, "return document.body.dataset.state") == "ok", 30,
             "the map once the page's identity contributed")  # fmt: skip
    assert js(driver, "return window.__sameDocument") is True
    assert int(js(driver, "return document.body.dataset.cells")) > 0
    shot(driver, "dashboard-contributed.png")
    assert js(driver, "return document.getElementById('notice').hidden") is True


def test_a_kept_token_the_cluster_does_not_know_is_replaced_a_given_one_is_not(
    cluster: LocalCluster, browser: Any
) -> None:
    """A token kept from another cluster (a demo run before) is dropped and
    a new identity registered; a token given in the address that the cluster
    does not know is said to be refused, not silently swapped."""
    lc, driver = cluster, browser
    base = f"{lc.queue_servers[0].http}/ui/?topic=munich"
    driver.get(base)
    wait_for(lambda: page_identity(driver)[0].startswith("cl-"), 30, "a registered identity")
    first = page_identity(driver)
    js(driver, "localStorage.setItem('roadlog.token', 'rl_from_another_cluster')")
    driver.get(base)
    wait_for(lambda: page_identity(driver)[0].startswith("cl-"), 30, "a new identity")
    again = page_identity(driver)
    assert again[1] != "rl_from_another_cluster" and again != first
    driver.get(base + "#token=rl_not_issued_here")  # the same page: a new fragment only
    wait_for(lambda: js(driver, "return document.body.dataset.state") == "unauthenticated", 30,
             "the page to say its token is refused")  # fmt: skip
    text = js(driver, "return document.getElementById('notice').innerText")
    assert "not accepted" in text
    assert js(driver, "return localStorage.getItem('roadlog.token')") == "rl_not_issued_here"


def test_the_streamed_heat_map_reaches_the_page(
    cluster: LocalCluster, browser: Any, tmp_path: Path
) -> None:
    """``roadlog heatmap stream --cluster DIR`` run as an operator runs it
    (its own process, nothing from the environment: the cluster's CA,
    certificate and Spark identity found in DIR), a trigger every 10 s: a
    ping in a cell nobody else reported, published while it runs, appears
    on the open page (how long it takes: bench/stream_delay.py)."""
    lc, driver = cluster, browser
    with Connection(lc.servers, tls=lc.tls()) as conn:  # a topic of its own: only streamed windows
        # The stream is what this looks at, not give-to-get's minimum: the
        # one ping below unlocks the page's identity.
        Admin(conn).create_topic("streamed", REGION.geojson, 2, contribution_min_pings=1,
                                 contribution_min_seconds=0)  # fmt: skip
        now = int(time.time() * 1000)
        Producer(conn, "streamed", client="alice").send_batch(
            PingColumns.from_columns(
                ["a1"], np.array([now]), np.array([HOT[0]]), np.array([HOT[1]])
            )
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROADLOG_")}
    log = tmp_path / "stream.log"
    with log.open("w") as out:
        stream = subprocess.Popen(
            [str(ROOT / ".venv/bin/roadlog"), "heatmap", "stream", "streamed", "--every", "10s",
             "--json", "--checkpoint", str(tmp_path / "checkpoint"), "--cluster", str(lc.dir)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
    try:

        def running() -> bool:
            assert stream.poll() is None, log.read_text()[-3000:]
            return True

        driver.get(f"{lc.queue_servers[0].http}/ui/?topic=streamed#token={lc.admin_token}")
        wait_for(lambda: running() and js(driver, "return document.body.dataset.state") == "ok",
                 180, "the page to draw the streamed heat map")  # fmt: skip
        probe = (48.19, 11.69)
        probe_cell = h3.latlng_to_cell(*probe, 9)
        assert js(driver, f"return window.roadlogDashboard.cells.has('{probe_cell}')") is False
        with Connection(lc.servers, tls=lc.tls()) as conn:
            now = int(time.time() * 1000)
            Producer(conn, "streamed", client="alice").send_batch(
                PingColumns.from_columns(
                    ["probe"],
                    np.array([now]),
                    np.array([probe[0]]),
                    np.array([probe[1]]),
                    speed_mps=np.array([3.0], dtype=np.float32),
                )
            )
        wait_for(
            lambda: running()
            and js(driver, f"return window.roadlogDashboard.cells.has('{probe_cell}')"),
            120, "the probe's cell on the page",
        )  # fmt: skip
        assert js(driver, "return document.body.dataset.state") == "ok"
        shot(driver, "dashboard-streamed.png")
        # each trigger said what it committed, as the Spark identity
        triggers = [json.loads(line) for line in log.read_text().splitlines()
                    if line.startswith("{")]  # fmt: skip
        assert triggers and all(t["topic"] == "streamed" for t in triggers)
    finally:
        stream.terminate()  # stops between triggers
        try:
            stream.wait(60)
        except subprocess.TimeoutExpired:
            stream.kill()
            stream.wait()
