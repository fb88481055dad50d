"""The streaming heat map's end-to-end delay: from a ping's acknowledgement
to its cell on an open dashboard page.

A local cluster (3 nodes, 1 queue server, TLS and tokens as deployed) with
steady background traffic in the south of the Munich topic (a simulated
five minutes before, then ``--rate`` pings a second), the stream run as an
operator runs it (``roadlog heatmap stream munich --every Ns``, its own
process, Spark local[2]) and the dashboard open in headless Chromium as the
identity that publishes. Each probe is one ping in a cell of the northern
strip that no other ping touches, published at a random point of the
trigger interval; the delay is from the publish's acknowledgement to the
moment the page has the probe's cell (the page is asked every 50 ms), split
into acknowledged-to-committed (the heat map's ``computed_ms``) and
committed-to-shown (the page polls the map's ETag every 2 s).

    .venv/bin/python -m bench.stream_delay [--every 10,60] [--probes 4]

Writes bench/results/stream_delay.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import h3
import numpy as np

from bench.common import write_result
from roadlog.client import Admin, Connection, Producer
from roadlog.columnar import PingColumns
from roadlog.geo import bbox_region, parse_region
from roadlog.tools.localcluster import LocalCluster
from roadlog.tools.traffic import TrafficSpec, simulate
from tests.integration.conftest import headless_chromium

ROOT = Path(__file__).resolve().parents[1]
REGION = bbox_region(11.45, 48.08, 11.70, 48.20)
TRAFFIC_BOX = (11.45, 48.08, 11.70, 48.17)  # background traffic: the south
PROBE_LAT = 48.19  # probes: the north strip, one new cell each
POLL_MS = 2000  # the dashboard's ETag poll (DashboardSettings.poll_ms)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


class Background(threading.Thread):
    """``rate`` pings a second at random points of the traffic box, stamped now."""

    def __init__(self, lc: LocalCluster, rate: int) -> None:
        super().__init__(daemon=True)
        self.lc, self.rate = lc, rate
        self.stop = threading.Event()
        self.sent = 0
        self.errors = 0

    def run(self) -> None:
        rng = np.random.default_rng(7)
        lon0, lat0, lon1, lat1 = TRAFFIC_BOX
        devices = [f"bg-{i:04d}" for i in range(self.rate)]
        with Connection(self.lc.servers, tls=self.lc.tls()) as conn:
            producer = Producer(conn, "munich", client="background")
            while not self.stop.wait(1.0):
                now = int(time.time() * 1000)
                cols = PingColumns.from_columns(
                    devices,
                    np.full(self.rate, now),
                    rng.uniform(lat0, lat1, self.rate),
                    rng.uniform(lon0, lon1, self.rate),
                    speed_mps=rng.uniform(1.0, 14.0, self.rate).astype(np.float32),
                )
                try:
                    producer.send_batch(cols)
                    self.sent += self.rate
                except Exception:
                    self.errors += 1


def js(driver: Any, script: str) -> Any:
    return driver.execute_script(script)


def wait(cond: Any, timeout: float, what: str, every: float = 0.05) -> float:
    """Wait for ``cond()``; the wall time it first held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.time()
        time.sleep(every)
    raise TimeoutError(f"no {what} after {timeout:.0f} s")


def run_stream(
    lc: LocalCluster, driver: Any, every_s: int, probes: int, work: Path, used: set[str]
) -> dict[str, Any]:
    say(f"stream with a trigger every {every_s} s: starting roadlog heatmap stream")
    log = (work / f"stream-{every_s}s.jsonl").open("w")
    err = (work / f"stream-{every_s}s.log").open("w")
    proc = subprocess.Popen(
        [str(ROOT / ".venv/bin/roadlog"), "heatmap", "stream", "munich",
         "--every", f"{every_s}s", "--window", "15m", "--json",
         "--checkpoint", str(work / f"checkpoint-{every_s}s"), "--cluster", str(lc.dir)],
        stdout=log, stderr=err, cwd=ROOT,
    )  # fmt: skip
    results: list[dict[str, Any]] = []

    def alive() -> bool:
        if proc.poll() is not None:
            err.flush()
            tail = (work / f"stream-{every_s}s.log").read_text().splitlines()[-5:]
            raise RuntimeError("the stream stopped:\n" + "\n".join(tail))
        return True

    try:
        # The page follows the stream's maps: wait for the first one it draws
        # after the stream started.
        started_ms = int(time.time() * 1000)
        wait(
            lambda: (
                alive()
                and (js(driver, "return window.roadlogDashboard.shown") or {}).get("computed_ms", 0)
                > started_ms
            ),
            240,
            "first streamed heat map on the page",
            every=0.5,
        )
        say("the page shows the stream's first heat map")
        rng = random.Random(every_s)
        lon = 11.455
        for i in range(probes):
            # a random phase of the trigger interval
            time.sleep(rng.uniform(0, every_s))
            while True:
                cell = h3.latlng_to_cell(PROBE_LAT, lon, 9)
                lon += 0.006
                if cell not in used:
                    used.add(cell)
                    break
            with Connection(lc.servers, tls=lc.tls()) as conn:
                now = int(time.time() * 1000)
                Producer(conn, "munich", client="probe").send_batch(
                    PingColumns.from_columns(
                        [f"probe-{every_s}-{i}"], np.array([now]), np.array([PROBE_LAT]),
                        np.array([h3.cell_to_latlng(cell)[1]]), speed_mps=np.array([3.0]),
                    )
                )  # fmt: skip
                acked = time.time()
            seen = wait(
                lambda c=cell: (
                    alive() and js(driver, f"return window.roadlogDashboard.cells.has('{c}')")
                ),
                3 * every_s + 120,
                f"probe {i}'s cell on the page",
            )
            computed = js(driver, "return window.roadlogDashboard.shown.computed_ms") / 1000
            r = {
                "ack_to_page_s": round(seen - acked, 2),
                "ack_to_commit_s": round(computed - acked, 2),
                "commit_to_page_s": round(seen - computed, 2),
            }
            results.append(r)
            say(
                f"probe {i + 1}/{probes}: shown {r['ack_to_page_s']:.1f} s after its ack "
                f"(committed after {r['ack_to_commit_s']:.1f} s, on the page "
                f"{r['commit_to_page_s']:.1f} s later)"
            )
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        err.close()
    triggers = []
    for line in (work / f"stream-{every_s}s.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError):
            triggers.append(json.loads(line)["seconds"])
    delays = [r["ack_to_page_s"] for r in results]
    return {
        "every_s": every_s,
        "probes": results,
        "ack_to_page_s": {
            "min": min(delays),
            "median": round(statistics.median(delays), 2),
            "max": max(delays),
        },
        "trigger_seconds": {
            "n": len(triggers),
            "median": round(statistics.median(triggers), 2) if triggers else None,
            "max": max(triggers) if triggers else None,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", default="10,60", help="trigger intervals to measure, seconds")
    ap.add_argument("--probes", type=int, default=4, help="probes per interval")
    ap.add_argument("--rate", type=int, default=200, help="background pings per second")
    ap.add_argument("--vehicles", type=int, default=300, help="vehicles of the first 5 minutes")
    args = ap.parse_args()
    if shutil.which("chromium") is None and not Path("/usr/bin/chromium").exists():
        sys.exit("needs Chromium (scripts/setup.sh installs it)")
    work = Path(tempfile.mkdtemp(prefix="roadlog-stream-delay-"))
    say(f"a local cluster in {work} (3 nodes, 1 queue server, TLS, tokens)")
    lc = LocalCluster.create(
        work / "c", 3, 1, extra_queue_args=["--dashboard-tile-url", ""], data_groups=1
    )  # one group, as measured
    lc.start_all()
    bg: Background | None = None
    try:
        lc.wait_ready(90)
        with Connection(lc.servers, tls=lc.tls()) as conn:
            Admin(conn).create_topic("munich", REGION.geojson, 4)
            end = int(time.time() * 1000)
            spec = TrafficSpec(vehicles=args.vehicles, duration_s=300, end_ms=end,
                               hotspots=((11.575, 48.137),))  # fmt: skip
            producer = Producer(conn, "munich", client="background")
            n = 0
            for cols in simulate(parse_region(bbox_region(*TRAFFIC_BOX).geojson), spec):
                producer.send_batch(cols)
                n += len(cols)
        say(f"published {n:,} simulated pings (the last 5 minutes); background traffic on")
        bg = Background(lc, args.rate)
        bg.start()
        q = lc.queue_servers[0]
        figures: list[dict[str, Any]] = []
        used: set[str] = set()
        with headless_chromium(1400, 900, trust=Path(q.certs_dir) / "queue.crt") as driver:
            driver.get(f"{q.http}/ui/?topic=munich#token={lc.admin_token}")
            for every in (int(x) for x in args.every.split(",")):
                figures.append(run_stream(lc, driver, every, args.probes, work, used))
                say(f"every {every} s: {figures[-1]['ack_to_page_s']}")
        bg.stop.set()
        bg.join(5)
        out = write_result(
            "stream_delay",
            {
                "what": "ping acknowledged to its cell on an open dashboard page "
                "(roadlog heatmap stream, Spark local[2], 3 nodes + 1 queue server on this "
                "machine, TLS and tokens, headless Chromium)",
                "poll_ms": POLL_MS,
                "window": "15m",
                "background_pings_per_s": args.rate,
                "background_sent": bg.sent,
                "background_errors": bg.errors,
                "runs": figures,
            },
        )
        say(f"wrote {out}")
    finally:
        if bg is not None:
            bg.stop.set()
        lc.down(grace=3)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
