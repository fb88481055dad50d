"""A write probe for drills: publishes one ping at a time for a while and
records the wall-clock time of every acknowledgement, so a drill can say how
long writes stopped (roadlog.tools.ops.write_pause).

    python -m roadlog.tools.probe --servers HOST:7500,... --duration 20 --out FILE

Prints (or writes to --out, atomically) {"acks": [...], "errors": N,
"last_error": "..."}. Errors while the cluster elects a leader are counted
and retried until the duration is over; the probe never gives up early.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from roadlog.client import Admin, AlreadyExists, Connection, Producer, RoadlogError
from roadlog.columnar import PingColumns
from roadlog.geo import bbox_region

# A small made-up region far from any city topic.
PROBE_REGION = bbox_region(10.0, 50.0, 10.01, 50.01).geojson


def run(servers: list[str], topic: str, duration_s: float) -> dict[str, object]:
    acks: list[float] = []
    errors, last_error = 0, ""
    deadline = time.monotonic() + duration_s
    with Connection(servers) as conn:
        while time.monotonic() < deadline:
            try:
                Admin(conn).create_topic(topic, PROBE_REGION, 1)
                break
            except AlreadyExists:
                break
            except RoadlogError as e:
                errors, last_error = errors + 1, str(e)
                time.sleep(0.2)
        producer = Producer(conn, topic, deadline_s=5.0, linger_s=0.0)
        n = 0
        while time.monotonic() < deadline:
            cols = PingColumns.from_columns(
                ["probe"], np.array([int(time.time() * 1000)]), np.array([50.005]),
                np.array([10.005]), speed_mps=np.array([1.0], dtype=np.float32),
            )  # fmt: skip
            try:
                producer.send_batch(cols)
                acks.append(time.time())
                n += 1
            except RoadlogError as e:
                errors, last_error = errors + 1, str(e)
                time.sleep(0.05)
    return {"acks": acks, "errors": errors, "last_error": last_error}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--servers", required=True, help="queue servers HOST:PORT,...")
    ap.add_argument("--topic", default="roadlog-drill")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds")
    ap.add_argument("--out", type=Path, help="write the result here (atomically)")
    args = ap.parse_args(argv)
    result = run(args.servers.split(","), args.topic, args.duration)
    text = json.dumps(result)
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, args.out)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
