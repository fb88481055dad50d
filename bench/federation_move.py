"""A topic move's pause and copy rate (issue 43, docs/federation.md "Topic
moves"): on a local directory and two one-node members, TLS and tokens.

One idempotent producer keeps 32 publishes of 100 pings in flight (a
``Publisher``, one producer id, its sequences in order) to a topic that
already holds ``--preload`` pings. Each round is a pair of windows of
``--window`` seconds, alternated: one without a move (the baseline), one
with the topic moved to the other member 2 s in (``TopicMove``, in a
thread; the producer follows the redirect). Per window: the longest gap
between two acknowledgements (the pause; goal under 5 s), acknowledgements
a second; per move: pings copied, its copy rate (pings a second, bulk and
fenced parts together) and how long writes were fenced. After each move
the new home holds exactly the preload plus every acknowledged ping
(checked), and a publish refused for good is counted (by window kind).
The topic moves back and forth, so later rounds copy more.
Medians and the spread. Writes bench/results/federation_move.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_result
from roadlog import columnar
from roadlog.client import Admin, Connection, RoadlogError
from roadlog.columnar import PingColumns
from roadlog.federation.directory import Directory
from roadlog.federation.move import MoveReport, TopicMove
from roadlog.geo import bbox_region
from roadlog.publisher import Publisher
from roadlog.tools.localcluster import LocalCluster
from roadlog.tools.localdirectory import directory_create, member_founding, wait_registered
from roadlog.v1 import client_pb2

TOPIC = "move-bench"
IN_FLIGHT, PINGS = 32, 100


def _member(root: Path, dd: Path, name: str) -> LocalCluster:
    f = member_founding(dd, name, [f"region={name}"])
    lc = LocalCluster.create(
        root / name, 1, 1, extra_queue_args=f.queue_args, ca=f.ca, cluster_name=name
    )
    lc.start_all()
    lc.wait_ready(60, admin_token=f.admin_token)
    wait_registered(dd, name)
    return lc


def _batch(n: int, seed: int) -> bytes:
    now = int(time.time() * 1000)
    i = np.arange(n)
    cols = PingColumns.from_columns(
        [f"bench-{seed}-{k % 50}" for k in range(n)],
        now - 60_000 + i,
        (48.1 + (i % 100) * 1e-4).astype(np.float64),
        (11.5 + (i % 100) * 1e-4).astype(np.float64),
        speed_mps=np.full(n, 10.0, dtype=np.float32),
    )
    return columnar.encode(cols)


async def _load(
    servers: list[str],
    tls: Any,
    pid: int,
    seq0: int,
    seconds: float,
    acks: list[float],
    errors: list[str],
    moving: threading.Thread | None = None,
) -> int:
    """IN_FLIGHT publishes of PINGS pings kept out for ``seconds``, and
    while ``moving`` runs and 2 s after; each acknowledgement's time in
    ``acks``, each refusal in ``errors``; returns the last sequence sent."""
    batch = _batch(PINGS, seq0)
    stop = time.monotonic() + seconds
    moved_at = 0.0

    def going() -> bool:
        nonlocal moved_at
        now = time.monotonic()
        if moving is not None and (moving.is_alive() or not moved_at):
            if not moving.is_alive():
                moved_at = now
            return True
        return now < max(stop, moved_at + 2.0)

    seq = seq0
    slots = asyncio.Semaphore(IN_FLIGHT)
    tasks: set[asyncio.Task[None]] = set()
    async with Publisher(servers, tls=tls, max_in_flight=4, timeout=60) as pub:

        async def one(s: int) -> None:
            req = client_pb2.PublishRequestView(
                topic=TOPIC, producer_id=pid, sequence=s, batch=batch
            ).SerializeToString()
            try:
                await pub.publish(req)
                acks.append(time.monotonic())
            except RoadlogError as e:
                errors.append(f"{time.monotonic():.3f} seq {s}: {e}")
            finally:
                slots.release()

        while going():
            await slots.acquire()
            seq += 1
            t = asyncio.create_task(one(seq))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    return seq


def _preload(conn: Connection, n: int) -> None:
    async def go() -> None:
        async with Publisher(conn.servers, tls=conn.tls) as pub:
            chunk = _batch(5000, 999)
            reqs = [
                pub.publish(
                    client_pb2.PublishRequestView(topic=TOPIC, batch=chunk).SerializeToString()
                )
                for _ in range(n // 5000)
            ]
            await asyncio.gather(*reqs)

    asyncio.run(go())


def _gap(acks: list[float], start: float) -> float:
    ts = [start, *sorted(acks)]
    return max(b - a for a, b in itertools.pairwise(ts)) if len(ts) > 1 else 0.0


def _stored(conn: Connection) -> int:
    return sum(p.next_offset - p.first_offset for p in Admin(conn).describe(TOPIC).partitions)


def run(rounds: int, window: float, preload: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="fed-move-bench-"))
    dd = root / "dd"
    clusters: list[LocalCluster] = []
    try:
        d = directory_create(dd, 1)
        clusters.append(d)
        d.start_all()
        d.wait_ready(60)
        members = {"eu": _member(root, dd, "eu"), "us": _member(root, dd, "us")}
        clusters += members.values()
        tls = d.tls()
        fed = Directory(d.servers, tls=tls)
        home = fed.place(TOPIC, on="eu")
        conn = fed.member(home)
        Admin(conn).create_topic(TOPIC, bbox_region(11.4, 48.05, 11.75, 48.25).geojson)
        _preload(conn, preload)
        pid = int(conn.call("InitProducer", client_pb2.InitProducerRequest()).producer_id)
        expected = _stored(conn)
        where, seq = "eu", 0
        base_gaps: list[float] = []
        move_gaps: list[float] = []
        rates: list[float] = []
        fenced: list[float] = []
        copied: list[int] = []
        acks_per_s: list[float] = []
        refused = {False: 0, True: 0}  # publishes refused for good, by window kind
        samples: list[str] = []
        for _ in range(rounds):
            for moving in (False, True):  # alternated: a baseline window, then a move
                acks: list[float] = []
                errors: list[str] = []
                report: list[MoveReport] = []
                to = "us" if where == "eu" else "eu"

                def move(to: str = to, report: list[MoveReport] = report) -> None:
                    time.sleep(2.0)
                    with Directory(d.servers, tls=tls) as mover:
                        report.append(TopicMove(mover, TOPIC, to).run())

                mover = threading.Thread(target=move) if moving else None
                servers = list(members[where].servers)
                start = time.monotonic()
                if mover is not None:
                    mover.start()
                seq = asyncio.run(_load(servers, tls, pid, seq, window, acks, errors, mover))
                refused[moving] += len(errors)
                samples.extend(errors[:2])
                if mover is not None:
                    mover.join(timeout=120)
                    assert report, "the move did not finish"
                    where = to
                    r = report[0]
                    rates.append(r.pings_per_s)
                    fenced.append(r.fenced_s)
                    copied.append(r.pings)
                    move_gaps.append(_gap(acks, start))
                else:
                    base_gaps.append(_gap(acks, start))
                acks_per_s.append(len(acks) / (time.monotonic() - start))
                expected += len(acks) * PINGS
                with Connection(members[where].servers, tls=tls) as c:
                    got = _stored(c)
                assert got == expected, f"{got} pings stored at {where}, {expected} acknowledged"
        fed.close()

        def spread(xs: list[float], nd: int = 3) -> dict[str, float]:
            return {
                "median": round(statistics.median(xs), nd),
                "min": round(min(xs), nd),
                "max": round(max(xs), nd),
            }

        return {
            "rounds": rounds,
            "window_s": window,
            "preload_pings": preload,
            "in_flight": IN_FLIGHT,
            "pings_per_publish": PINGS,
            "longest_ack_gap_s_no_move": spread(base_gaps),
            "longest_ack_gap_s_move": spread(move_gaps),
            "fenced_s": spread(fenced),
            "copy_pings_per_s": spread(rates, 0),
            "pings_copied": {"min": min(copied), "max": max(copied)},
            "acks_per_s": spread(acks_per_s, 1),
            "publishes_refused_no_move": refused[False],
            "publishes_refused_move": refused[True],
            "refusals": samples[:4],
        }
    finally:
        for lc in reversed(clusters):
            lc.down(grace=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window", type=float, default=8.0, help="seconds of load per window")
    ap.add_argument("--preload", type=int, default=200_000, help="pings in the topic first")
    args = ap.parse_args()
    figures = run(args.rounds, args.window, args.preload)
    print(figures)
    print(write_result("federation_move", figures))


if __name__ == "__main__":
    main()
