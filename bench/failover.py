"""Failover: the time from SIGKILL of the leader to the next acknowledged
write, over N trials, for roadlog (3 nodes) and NATS JetStream (3 servers,
the stream leader's server killed). A writer publishes 100-ping batches
back to back; the pause is measured from the kill to the first ack after it.
Also the catch-up rate of a wiped roadlog node (MB/s of state shipped and
installed). Writes bench/results/failover.json.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from typing import Any

import grpc

from bench.common import write_result
from bench.ingest import batch_request
from bench.peers import NatsCluster, nats_cluster, nats_stream, roadlog_cluster
from roadlog.client import Connection, Producer
from roadlog.columnar import PingColumns
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import admin_pb2, admin_pb2_grpc


async def _writer(send: Any, stop: asyncio.Event, acks: list[tuple[float, float]]) -> None:
    """Publish back to back; record (sent, acknowledged) times."""
    while not stop.is_set():
        sent = time.perf_counter()
        try:
            await send()
            acks.append((sent, time.perf_counter()))
        except Exception:
            await asyncio.sleep(0.005)


def first_ack_sent_after(acks: list[tuple[float, float]], t: float) -> float | None:
    """The first acknowledgment of a request sent after ``t`` (one a dead
    leader cannot have answered)."""
    return min((a for s, a in acks if s > t), default=None)


async def measure_pause(send: Any, kill: Any, limit_s: float = 60.0) -> float:
    """Publish back to back, run ``kill()``, and return the seconds from the
    kill to the first acknowledgment of a request sent after it (the same
    measurement for every system)."""
    stop = asyncio.Event()
    acks: list[tuple[float, float]] = []
    task = asyncio.create_task(_writer(send, stop, acks))
    while len(acks) < 20:
        await asyncio.sleep(0.01)
    killed_at = time.perf_counter()
    await kill()
    deadline = killed_at + limit_s
    while first_ack_sent_after(acks, killed_at) is None and time.perf_counter() < deadline:
        await asyncio.sleep(0.002)
    stop.set()
    await task
    return (first_ack_sent_after(acks, killed_at) or deadline) - killed_at


async def roadlog_trials(lc: LocalCluster, trials: int) -> list[float]:
    payload = batch_request(100)
    pauses: list[float] = []
    # As a client: the cluster's TLS when it has it, and the admin identity's
    # token (the queue server refuses a call without one: UNAUTHENTICATED,
    # which this bench once took for a pause it never saw end).
    tls = lc.tls()
    async with tls.aio_channel(lc.servers[0]) as ch:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(
            "/roadlog.v1.Roadlog/Publish"
        )

        async def send() -> None:
            await call(payload, timeout=5, metadata=tls.metadata())

        for t in range(trials):
            await asyncio.to_thread(lc.wait_ready, 60)
            leader = (await asyncio.to_thread(lc.status))["leader"]
            pause = await measure_pause(send, lambda n=leader: asyncio.to_thread(lc.kill, n))
            pauses.append(pause)
            print(f"roadlog trial {t + 1}: {pause * 1000:.0f} ms", file=sys.stderr, flush=True)
            await asyncio.to_thread(lc.start, leader)
    return pauses


async def nats_trials(nc: NatsCluster, trials: int) -> list[float]:
    conn, js = await nats_stream(nc)
    payload = b"x" * 3600
    pauses: list[float] = []

    async def send() -> None:
        await js.publish("pings.bench", payload, timeout=2)

    try:
        for t in range(trials):
            # Wait for a healthy stream with a leader and current replicas.
            while True:
                try:
                    info = await js.stream_info("PINGS")
                    cl = info.cluster
                    if cl and cl.leader and cl.replicas and all(r.current for r in cl.replicas):
                        break
                except Exception:
                    pass
                await asyncio.sleep(0.2)
            victim = nc.by_name(info.cluster.leader)
            pause = await measure_pause(send, lambda v=victim: asyncio.to_thread(v.kill))
            pauses.append(pause)
            print(f"jetstream trial {t + 1}: {pause * 1000:.0f} ms", file=sys.stderr, flush=True)
            victim.start()
    finally:
        await conn.close()
    return pauses


def catch_up(pings: int) -> dict[str, Any]:
    """Wipe a follower, restart it, time until its state digest matches."""
    with roadlog_cluster(extra=["--snapshot-entries", "50"]) as lc:
        with Connection(lc.servers, tls=lc.tls()) as conn:
            p = Producer(conn, "bench", idempotent=False)
            now = int(time.time() * 1000)
            import numpy as np

            batch = 5000
            for k in range(pings // batch):
                cols = PingColumns.from_columns(
                    [f"d{i % 500}" for i in range(batch)],
                    np.full(batch, now - k, dtype=np.int64),
                    np.full(batch, 48.1),
                    np.full(batch, 11.5),
                    speed_mps=np.full(batch, 9.0, dtype=np.float32),
                )
                p.send_batch(cols)
        st = lc.status()
        victim = next(n for n in lc.nodes if n.id != st["leader"])
        lc.kill(victim.id)
        shutil.rmtree(victim.data_dir)

        def digest(addr: str) -> tuple[int, bytes]:
            with grpc.insecure_channel(addr) as ch:
                r = admin_pb2_grpc.AdminStub(ch).StateDigest(
                    admin_pb2.StateDigestRequest(), timeout=30
                )
            return r.applied_index, r.sha256

        leader = next(n for n in lc.nodes if n.id == st["leader"])
        want = digest(leader.address)
        snap = sorted((lc.dir / f"node{leader.id}" / "snapshots").glob("snap-*.mdb"))
        size = snap[-1].stat().st_size if snap else 0
        t0 = time.perf_counter()
        lc.start(victim.id)
        while True:
            try:
                if digest(victim.address)[0] >= want[0]:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        elapsed = time.perf_counter() - t0
        same = digest(victim.address) == digest(leader.address)
        return {
            "pings": pings,
            "snapshot_mb": round(size / 1e6, 1),
            "seconds": round(elapsed, 2),
            "mb_per_s": round(size / 1e6 / elapsed, 1),
            "identical": same,
        }


def summary(pauses: list[float]) -> dict[str, Any]:
    return {
        "trials": len(pauses),
        "median_ms": round(statistics.median(pauses) * 1000, 1),
        "max_ms": round(max(pauses) * 1000, 1),
        "all_ms": [round(p * 1000, 1) for p in pauses],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--catch-up-pings", type=int, default=2_000_000)
    args = ap.parse_args(argv)
    with roadlog_cluster() as lc:
        ours = asyncio.run(roadlog_trials(lc, args.trials))
    with nats_cluster() as nc:
        theirs = asyncio.run(nats_trials(nc, args.trials))
    cu = catch_up(args.catch_up_pings)
    print(f"catch-up: {cu}", file=sys.stderr)
    r, j = summary(ours), summary(theirs)
    ratio = round(r["median_ms"] / max(j["median_ms"], 1e-9), 3)
    print(
        f"failover median roadlog {r['median_ms']} ms, jetstream {j['median_ms']} ms",
        file=sys.stderr,
    )
    print(
        write_result(
            "failover", {"roadlog": r, "jetstream": j, "median_ratio": ratio, "catch_up": cu}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
