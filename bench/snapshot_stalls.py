"""Ack stalls around snapshots: where the slow acks of a steady ingest fall.

Three nodes and a queue server on loopback take `--seconds` of corked
publishes of `--pings` pings each from 32 publishers (the load of
bench/ingest.py). The run is cut into 100 ms windows by the time each
publish was sent; the windows whose slowest ack took over 60 ms are listed
beside the nodes' snapshot log lines (each with `copy_s`, `checkpoint_s`,
`compact_s` and `bytes`), so that a stall can be put on what caused it.
`--node-flags` passes flags to every node (e.g. `--snapshot-mib-per-s 0`,
`--snapshot-bytes 8589934592`), to compare. Writes
bench/results/snapshot-stalls.json (or snapshot-stalls-flags.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import write_result
from bench.cpu import cpu_seconds
from bench.ingest import batch_request
from bench.peers import percentile, roadlog_cluster
from roadlog.client_tls import ClientTLS
from roadlog.publisher import Publisher
from roadlog.runtime import eventloop

WINDOW_S = 0.1
SLOW_MS = 60.0


async def load(
    servers: list[str], tls: ClientTLS, pings: int, seconds: float, publishers: int
) -> list[tuple[float, float]]:
    """(sent at, seconds to its ack) of every publish, from ``publishers``
    coroutines through one corked Publisher."""
    payload = batch_request(pings)
    done: list[tuple[float, float]] = []
    async with Publisher(servers, tls=tls) as pub:
        end = time.monotonic() + seconds
        last_report = time.monotonic()

        async def one() -> None:
            nonlocal last_report
            while time.monotonic() < end:
                t = time.monotonic()
                await pub.publish(payload)
                done.append((t, time.monotonic() - t))
                if t - last_report >= 5:
                    last_report = t
                    print(f"  {len(done)} acks", file=sys.stderr)

        await asyncio.gather(*(one() for _ in range(publishers)))
    return done


def snapshot_lines(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if '"snapshot and compaction"' in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--pings", type=int, default=1000, help="pings per message")
    ap.add_argument("--publishers", type=int, default=32)
    ap.add_argument("--node-flags", default="", help="more flags for every node, one string")
    args = ap.parse_args(argv)
    with roadlog_cluster(extra=shlex.split(args.node_flags)) as lc:
        pids = [n.pid for n in lc.nodes] + [q.pid for q in lc.queue_servers]
        cpu0, wall0, t0 = sum(map(cpu_seconds, pids)), time.time(), time.monotonic()
        acks = eventloop.run(load(lc.servers, lc.tls(), args.pings, args.seconds, args.publishers))
        cpu = sum(map(cpu_seconds, pids)) - cpu0
        snapshots = [
            {"node": n.id, "at_s": round(_epoch(s["ts"]) - wall0, 2), **_phases(s)}
            for n in lc.nodes
            for s in snapshot_lines(Path(n.log))
        ]
    windows: dict[int, float] = {}
    for sent, took in acks:
        w = int((sent - t0) / WINDOW_S)
        windows[w] = max(windows.get(w, 0.0), took)
    slow = [
        {"at_s": round(w * WINDOW_S, 1), "slowest_ms": round(v * 1000, 1)}
        for w, v in sorted(windows.items())
        if v * 1000 > SLOW_MS
    ]
    lat = sorted(took for _, took in acks)
    pings = len(acks) * args.pings
    figures = {
        "pings_per_message": args.pings,
        "publishers": args.publishers,
        "seconds": args.seconds,
        "node_flags": args.node_flags,
        "pings_per_s": round(pings / args.seconds),
        "ack_p50_ms": round(percentile(lat, 0.5) * 1000, 2),
        "ack_p99_ms": round(percentile(lat, 0.99) * 1000, 2),
        "ack_max_ms": round(lat[-1] * 1000, 1) if lat else 0.0,
        "server_cpu_s_per_m_pings": round(cpu / max(pings, 1) * 1e6, 3),
        "slow_windows": slow,
        "snapshots": sorted(snapshots, key=lambda s: s["at_s"]),
    }
    for s in figures["snapshots"]:
        print(f"snapshot node {s['node']} done at {s['at_s']} s: {s}", file=sys.stderr)
    print(
        f"{figures['pings_per_s']:,} pings/s  p50 {figures['ack_p50_ms']} ms  "
        f"p99 {figures['ack_p99_ms']} ms  max {figures['ack_max_ms']} ms  "
        f"{len(slow)} windows over {SLOW_MS:.0f} ms: "
        f"{[(w['at_s'], w['slowest_ms']) for w in slow]}  "
        f"server CPU-s/M pings {figures['server_cpu_s_per_m_pings']}",
        file=sys.stderr,
    )
    print(write_result("snapshot-stalls" + ("-flags" if args.node_flags else ""), figures))
    return 0


def _epoch(ts: str) -> float:
    """A log line's ISO time (UTC, ms) as seconds since the epoch."""
    return datetime.strptime(ts.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def _phases(line: dict[str, Any]) -> dict[str, Any]:
    keys = ("index", "copy_s", "checkpoint_s", "compact_s", "bytes")
    return {k: line[k] for k in keys if k in line}


if __name__ == "__main__":
    sys.exit(main())
